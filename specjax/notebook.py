"""What the notebooks in experiments/notebooks/ share once specjax is installed: where they run, at
which precision, and the one summary line their CI check reads (tests/test_notebooks.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax

SUMMARY_PREFIX = "specjax-notebook-summary:"
"""Marks the line of key numbers a notebook prints last; the CI check parses what follows it."""


@dataclasses.dataclass(frozen=True)
class NotebookEnv:
    """Where a notebook runs."""

    backend: str
    """jax's default backend: cpu, gpu or tpu."""
    device: str
    """The first device's kind, e.g. "NVIDIA H200" or "cpu"."""
    device_count: int
    """Devices of that backend."""
    dtype: str
    """Compute precision the notebook's models use: bfloat16 on accelerators, where it is native;
    `--dtype auto`'s choice on a CPU."""


def setup(dtype: str = "auto") -> NotebookEnv:
    """Detect the accelerator, pick the compute dtype and say what was chosen.
    dtype: "auto" (bfloat16 on GPU and TPU, the CLI's auto choice on CPU), float32 or bfloat16."""
    from specjax.io.registry import COMPUTE_DTYPES, compute_dtype
    from specjax.errors import SpecjaxError

    backend = jax.default_backend()
    devices = jax.devices()
    if dtype == "auto":
        dtype = "bfloat16" if backend in ("gpu", "tpu") else compute_dtype("auto")
    elif dtype not in COMPUTE_DTYPES:
        raise SpecjaxError(f"unknown dtype {dtype!r}; available: auto, {', '.join(COMPUTE_DTYPES)}")
    env = NotebookEnv(backend, devices[0].device_kind, len(devices), dtype)
    cores = f", {os.cpu_count()} CPU cores" if backend == "cpu" else ""
    print(f"specjax {_version()} on {env.device_count} x {env.device} ({backend}{cores}); models compute in {dtype}"
          + ("" if backend != "cpu" else " (no GPU or TPU found: expect minutes, not seconds)"))
    return env


def load_target(env: NotebookEnv, name: str = "smollm2"):
    """The target at the notebook's precision. Under bf16 every decode-time forward is padded to the
    same query rows, so speculative output stays token-for-token AR's (io/registry.with_query_rows)."""
    from specjax.io.registry import load_model, with_query_rows

    return with_query_rows(load_model(name, env.dtype), "auto")


def summary(**numbers) -> dict:
    """Print the notebook's key numbers as one JSON line (the CI check reads it) and return them.
    Non-finite numbers are printed as they are, so the check can fail on them."""
    line = json.dumps(numbers, default=float)
    print(f"{SUMMARY_PREFIX} {line}")
    return numbers


def read_summary(text: str) -> dict:
    """The numbers of the last summary line in a notebook's printed output."""
    lines = [ln for ln in text.splitlines() if ln.startswith(SUMMARY_PREFIX)]
    if not lines:
        raise ValueError("the notebook printed no summary line")
    return json.loads(lines[-1][len(SUMMARY_PREFIX):])


def non_finite(numbers) -> list[str]:
    """Paths of NaN or infinite numbers anywhere in a summary (nested lists and dicts)."""
    bad = []

    def visit(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{path}.{key}" if path else key)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(path)

    visit(numbers, "")
    return bad


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specjax")
    except PackageNotFoundError:
        return "(source tree)"
