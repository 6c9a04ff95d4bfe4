"""How big a draft tree pays for itself: the acceptance proxy, the size rule and the latency model.

A step costs T(n) = T_fixed + C(n): drafting and bookkeeping, plus verifying n tree nodes. It
commits about S(n) = sum of P(v) over the first n nodes in pop order (the root's P = 1 is the
bonus/correction token). The loop verifies one of a few compiled sizes (buckets), each filled with
the next nodes in pop order, so the rule picks the bucket b with the most committed tokens per
second, S(b) / T(b). Bastion's stop rule (add node v while P(v) * T(n) > S(n) * (C(n+1) - C(n)))
is that choice made greedily, which is exact for a convex C; a measured C can be a step instead
(one refitted on this CPU in bf16, rows padded to 16: 1 node 39 ms, 2 to 16 nodes 46 ms), and there
the greedy rule stops at the first dear node and never sees the free ones behind it.

C(n) is not a constant of the method: on a CPU verifying 64 tokens costs several decode steps,
on a GPU about one. So it is measured on this machine for each (model, batch, cache length),
interpolated between the measured sizes, cached on disk per machine and model, and refitted
online from the wall time of every decode call (`LatencyModel.observe`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.files import make_dir


LATENCY_FORMAT = 7
"""Bumped whenever what a step does changes, so stale measurements on disk are not reused."""


@struct.dataclass
class TreeCosts:
    """The latency model as the jitted loop sees it: dynamic arrays, so refits never recompile."""

    sizes: jax.Array
    """[M] float32 node counts where verification was measured, increasing (1 first)."""
    verify_s: jax.Array
    """[M] float32 seconds of one verify pass at each size."""
    fixed_s: jax.Array
    """[] float32 seconds per step that do not depend on the tree size (drafting, bookkeeping)."""

    def verify_cost(self, num_nodes):
        """C(n) by linear interpolation (constant extrapolation past the ends)."""
        return jnp.interp(num_nodes.astype(jnp.float32), self.sizes, self.verify_s)


def chosen_bucket(log_prob, valid, live, costs: TreeCosts, buckets: tuple[int, ...]):
    """The size rule for a batch, which verifies one bucket for every row. log_prob, valid: [B, N]
    in pop order; live: [B] bool (rows still decoding); buckets: the compiled sizes, increasing.
    Returns (bucket index [] int32, its node count [] int32).

    The bucket with the most committed tokens per second over the live rows,
        argmax_b  sum_rows S(b) / (T_fixed + C(b)),
    the smaller on a tie. C is measured at the batch's size, so on hardware where verifying costs
    grow with batch x nodes the same rule picks smaller trees."""
    num_nodes = log_prob.shape[1]
    path_prob = jnp.where(valid & live[:, None], jnp.exp(log_prob), 0.0)  # [B, N]
    proxy = jnp.cumsum(jnp.sum(path_prob, axis=0))  # [N]: proxy[n-1] = summed S(n)
    sizes = jnp.asarray(buckets, jnp.int32)  # [M]
    committed = proxy[jnp.minimum(sizes, num_nodes) - 1]  # [M]
    index = jnp.argmax(committed / (costs.fixed_s + costs.verify_cost(sizes))).astype(jnp.int32)
    return index, sizes[index]


def interleaved_min_seconds(repeats: int, fns: dict) -> dict:
    """The least wall time of every fn over `repeats` rounds, each round calling all of them once
    in turn, after one untimed call each (compile, warm-up). Taking turns spreads a slow spell of a
    shared machine over every fn instead of one, and the least time drops the spell (noise here
    only ever adds), so the differences between fns are their own."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    best = {key: float("inf") for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def monotone_costs(seconds) -> list[float]:
    """The closest non-decreasing curve (least squares, scipy's isotonic regression): verifying
    more nodes never costs less, so a dip is noise, and the size rule would read it as a free node."""
    from scipy.optimize import isotonic_regression

    return [float(x) for x in isotonic_regression(np.asarray(seconds, float), increasing=True).x]


def median_seconds(repeats: int, fn) -> float:
    """Median wall time of fn() over `repeats` calls, after one untimed call (compile, warm-up)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def machine_id() -> str:
    """What a measured latency belongs to: the backend's device kind (or the CPU model)."""
    device = jax.devices()[0]
    kind = device.device_kind
    if device.platform == "cpu":
        kind = f"{_cpu_model()} x{os.cpu_count()}"
    return f"{device.platform}:{kind}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclasses.dataclass
class LatencyModel:
    """Measured per-step costs for one (machine, model, batch, cache length, buckets), refitted
    online. Observations are whole decode calls:
        wall = per_call + steps * fixed + sum_b count_b * C(b),
    where per_call (prefill and launch) is fitted too, so short calls do not inflate the step costs."""

    sizes: list[int]
    """Node counts measured, increasing; 1 (a plain decode step) first, then the tree buckets."""
    verify_s: list[float]
    """Seconds of one verify pass at each size."""
    fixed_s: float
    """Seconds of the size-independent part of a step."""
    prior_verify_s: list[float] = dataclasses.field(default_factory=list)
    """The first measurement, which the online fit is pulled toward when data are few."""
    prior_fixed_s: float = 0.0
    per_call_s: float = 0.0
    """Seconds per decode call outside the loop (prefill, launch), fitted from observations."""
    observations: list[dict] = dataclasses.field(default_factory=list)
    """{"steps": int, "counts": {size: verify passes}, "wall_s": float} per decode call (newest last)."""

    max_observations = 64
    prior_weight = 0.3
    """Ridge weight, in units of one observation's relative error."""
    per_call_scale_s = 0.2
    """Typical per-call cost; its ridge (toward 0) is relative to this."""

    def __post_init__(self):
        if not self.prior_verify_s:
            self.prior_verify_s = list(self.verify_s)
            self.prior_fixed_s = self.fixed_s

    def costs(self) -> TreeCosts:
        return TreeCosts(jnp.asarray(self.sizes, jnp.float32), jnp.asarray(self.verify_s, jnp.float32),
                         jnp.float32(self.fixed_s))

    def observe(self, steps: int, counts: dict[int, int], wall_s: float) -> None:
        """Add one decode call and refit: a least-squares fit in relative error, with a ridge toward
        the first measurement so sizes that are rarely used stay where they were measured."""
        if steps <= 0 or wall_s <= 0:
            return
        self.observations.append({"steps": int(steps), "counts": {int(k): int(v) for k, v in counts.items()},
                                  "wall_s": float(wall_s)})
        self.observations = self.observations[-self.max_observations:]
        self._refit()

    def _refit(self) -> None:
        # Unknowns: per_call_s, fixed_s, and C at every measured size the loop has run. A size it
        # never ran (1 where it is no bucket: an anchor of the interpolation) stays as measured. Size
        # 1 is fitted once run: pinned at its isolated time, it once left every cost of a step that
        # the isolated passes miss to the larger sizes, so a flat curve (bf16, rows padded to 16)
        # was refitted into 1 node at 52 ms against 80-88 ms for 2-16, and the rule stopped drafting.
        run = {s for obs in self.observations for s, c in obs["counts"].items() if c}
        fitted = [s for s in self.sizes if s != 1 or 1 in run]
        prior = np.array([0.0, self.prior_fixed_s] + [self.prior_verify_s[self.sizes.index(s)] for s in fitted])
        scale = np.maximum(prior, 1e-9)
        scale[0] = self.per_call_scale_s
        # Observation rows in relative error (each call counts alike whatever its length), then ridge
        # rows (x_j - prior_j) / scale_j ~ 0.
        rows = [np.array([1.0, obs["steps"]] + [obs["counts"].get(s, 0) for s in fitted], float) / obs["wall_s"]
                for obs in self.observations]
        a = np.vstack(rows + [np.diag(self.prior_weight / scale)])
        b = np.concatenate([np.ones(len(rows)), self.prior_weight * prior / scale])
        solution, *_ = np.linalg.lstsq(a, b, rcond=None)
        solution[1:] = np.clip(solution[1:], 0.2 * prior[1:], 5.0 * prior[1:])
        self.per_call_s = float(max(solution[0], 0.0))
        self.fixed_s = float(solution[1])
        for s, value in zip(fitted, solution[2:]):
            self.verify_s[self.sizes.index(s)] = float(value)
        self.verify_s = monotone_costs(self.verify_s)

    def predicted_wall_s(self, steps: int, counts: dict[int, int]) -> float:
        return self.per_call_s + steps * self.fixed_s + sum(c * self.verify_s[self.sizes.index(s)] for s, c in counts.items())

    # ---- on-disk cache, one file per key ----

    @staticmethod
    def key(model_name: str, model_config, batch: int, cache_length: int, sizes) -> str:
        digest = hashlib.sha256(repr((model_name, model_config, batch, cache_length, tuple(sizes))).encode()).hexdigest()
        return f"v{LATENCY_FORMAT}|{machine_id()}|{model_name}|b{batch}|s{cache_length}|{digest[:12]}"

    @staticmethod
    def path_for(key: str, folder: Path) -> Path:
        return folder / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")

    def save(self, key: str, folder: Path) -> None:
        make_dir(folder, "the latency cache")
        data = {"key": key, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
        tmp = self.path_for(key, folder).with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path_for(key, folder))

    @classmethod
    def load(cls, key: str, folder: Path) -> "LatencyModel | None":
        path = cls.path_for(key, folder)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if data.pop("key", None) != key:
            return None
        data["observations"] = [{**o, "counts": {int(k): v for k, v in o["counts"].items()}}
                                for o in data.get("observations", [])]
        return cls(**data)
