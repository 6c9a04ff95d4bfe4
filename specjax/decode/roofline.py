"""What a decode step asks of the machine, against what the machine can do: the stall estimate.

A step's work is modelled from shapes. FLOPs: two per multiply-add over every weight for every
token a row verifies (and drafts), plus attention over the cache slots the step reads. Bytes: the
weights, read once per step, plus the K/V slots attention reads. Every row of the batch counts,
live or not, since a batched step computes them all. Divided by the measured step time, that is
the achieved FLOP/s and bytes/s; against the machine's peaks (measured once per machine, cached),
it says whether the engine is bound by memory traffic, by arithmetic, or by neither (overheads,
small matrices that run far below peak).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.decode.budget import machine_id, median_seconds
from specjax.files import make_dir
from specjax.models.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class MachinePeaks:
    """The machine's measured ceilings (one device)."""

    flops_per_s: float
    """A large matmul's FLOP/s at the compute dtype (bf16: bf16 inputs, float32 accumulation, as
    the model's projections run)."""
    bytes_per_s: float
    """Reading a large float32 array once (a sum), in bytes/s."""


def measure_peaks(folder: Path | None = None, matmul: int = 1024, array_mib: int = 256,
                  dtype: str = "float32") -> MachinePeaks:
    """Measure (or load) this machine's peaks for a model computing in `dtype`. folder: where they
    are cached (None: measure only). A bf16 peak can be several times the float32 one (AMX)."""
    path = None
    if folder is not None:
        key = (f"{machine_id()}|{platform.machine()}|{os.cpu_count()}|m{matmul}|a{array_mib}|jax{jax.__version__}"
               + ("" if dtype == "float32" else f"|{dtype}"))
        path = Path(folder) / "peaks.json"
        if path.exists():
            try:
                cached = json.loads(path.read_text())
                if key in cached:
                    return MachinePeaks(**cached[key])
            except (OSError, json.JSONDecodeError, TypeError):
                pass
    a = jax.random.normal(jax.random.key(0), (matmul, matmul), jnp.float32).astype(dtype)
    product = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    flops = 2 * matmul**3 / median_seconds(5, lambda: product(a))
    array = jnp.ones((array_mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    bandwidth = array.nbytes / median_seconds(5, lambda: total(array))
    peaks = MachinePeaks(float(flops), float(bandwidth))
    if path is not None:
        make_dir(path.parent, "the machine-peaks cache")
        cached = json.loads(path.read_text()) if path.exists() else {}
        cached[key] = dataclasses.asdict(peaks)
        path.write_text(json.dumps(cached, indent=1))
    return peaks


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one batched verify step computes, for the work model."""

    target_config: TransformerConfig
    target_weight_bytes: int
    rows: int
    """Rows the step computes (every slot, live or not)."""
    drafter_config: object | None = None
    drafter_weight_bytes: int = 0
    draft_head_columns: int = 0
    """Columns of the draft head (the draft vocabulary), multiplied for every draft slot."""


def step_work(shape: StepShape, verify_tokens: float, attend_slots: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one verify step: every row verifies verify_tokens tokens (1 for AR, the
    block for a chain, the tree's nodes) attending to attend_slots cache slots."""
    cfg, rows = shape.target_config, shape.rows
    kv_element = jnp.dtype(cfg.cache_dtype).itemsize
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attend_slots  # per query token
    flops = rows * verify_tokens * (2 * cfg.num_params() + attention)
    bytes_read = shape.target_weight_bytes + rows * attend_slots * cfg.kv_bytes_per_token(kv_element)
    dcfg = shape.drafter_config
    if dcfg is not None:
        layer = dcfg.layer_config
        block = dcfg.block_size
        draft_params = shape.drafter_weight_bytes / jnp.dtype(layer.dtype).itemsize
        context_slots = attend_slots  # windowed drafting attends to its window and the summaries only
        if dcfg.window is not None:
            context_slots = min(attend_slots, dcfg.window.ring_slots(block) + dcfg.window.summary_slots(attend_slots))
        draft_attention = 4 * layer.num_layers * layer.num_heads * layer.head_dim * context_slots
        flops += rows * block * (2 * draft_params + draft_attention)
        flops += rows * (block - 1) * 2 * layer.hidden_size * shape.draft_head_columns
        bytes_read += (shape.drafter_weight_bytes + layer.hidden_size * shape.draft_head_columns * 4
                       + rows * context_slots * layer.kv_bytes_per_token(jnp.dtype(layer.dtype).itemsize))
    return float(flops), float(bytes_read)
