"""GPU check of the Pallas tree-attention kernel: does it compile, is it right, and is it faster than XLA?

    python experiments/gpu_tree_attention_check.py [--json PATH] [--repeats 20] [--budget-s 270]
    python experiments/gpu_tree_attention_check.py --allow-cpu --quick     # tiny shapes, interpret mode

Meant for one short session on a GPU machine (jax with CUDA; no network needed). Three steps:
1. print the jax version and the device;
2. correctness: compile the kernel (Triton, interpret=False) and compare it with the jnp reference in
   float32 and bfloat16 on a few shapes (random trees, chains, a decode step, ragged prefixes);
3. timing: SmolLM2-135M attention heads (H=9, Kh=3, D=64) in bfloat16, tree sizes T in 16..512 and
   cache lengths S in 1024..8192 with prefix length S - T, batch 1 and 4; both implementations jitted,
   median of --repeats calls after a warm-up call that also compiles. Printed as a markdown table.

Every shape runs in its own try block, so a compile error for one shape becomes a row of the table and
the script moves on. A time budget (--budget-s, counted from the start) keeps the whole run short:
rows past it are reported as skipped. Imports only jax, numpy and specjax.pallas_kernels (which itself
imports only jax and numpy).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from specjax.pallas_kernels.tree_attention import BlockSizes, tree_attention, tree_attention_reference  # noqa: E402

# SmolLM2-135M attention: 9 query heads over 3 kv heads of width 64.
FULL_HEADS = dict(num_heads=9, num_kv_heads=3, head_dim=64)
QUICK_HEADS = dict(num_heads=6, num_kv_heads=3, head_dim=16)
# Pass/fail bounds on the max abs error against the reference. float32 runs both sides at full matmul
# precision, so only the summation order differs; bfloat16 is a few ulps at output magnitude ~2.
TOLERANCE = {"float32": 2e-4, "bfloat16": 4e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One tree-attention problem size."""

    batch: int
    """B: sequences."""
    num_new: int
    """T: tree nodes (queries) per sequence."""
    cache_length: int
    """S: cache slots."""
    tree: str
    """"random" (random parent < node), "chain" (lower triangular) or "star" (root plus siblings)."""
    prefixes: str
    """"ragged" (0, S, then random) or "full" (every row has prefix S - T)."""


def tree_masks(rng: np.random.Generator, kind: str, batch: int, num_new: int) -> np.ndarray:
    """[B, T, T] ancestor-or-self masks."""
    masks = np.zeros((batch, num_new, num_new), bool)
    for row in range(batch):
        if kind == "chain":
            parents = list(range(-1, num_new - 1))
        elif kind == "star":
            parents = [-1] + [0] * (num_new - 1)
        else:
            parents = [-1] + [int(rng.integers(0, node)) for node in range(1, num_new)]
        mask = np.eye(num_new, dtype=bool)
        for node, parent in enumerate(parents):
            if parent >= 0:
                mask[node] |= mask[parent]
        masks[row] = mask
    return masks


def make_inputs(seed: int, shape: Shape, heads: dict, dtype) -> dict:
    """Random arguments on the default device; the cache past each prefix is filled with huge garbage."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 5)
    batch, num_new, cache_length = shape.batch, shape.num_new, shape.cache_length
    num_heads, num_kv_heads, head_dim = heads["num_heads"], heads["num_kv_heads"], heads["head_dim"]
    if shape.prefixes == "ragged":
        prefix_lengths = np.concatenate([[0, cache_length], rng.integers(0, cache_length + 1, size=batch)])[:batch]
    else:
        prefix_lengths = np.full(batch, cache_length - num_new)
    prefix_lengths = jnp.asarray(prefix_lengths, jnp.int32)  # [B]
    cache_shape = (batch, cache_length, num_kv_heads, head_dim)
    stale = jnp.arange(cache_length)[None, :, None, None] >= prefix_lengths[:, None, None, None]  # [B, S, 1, 1]
    garbage = jnp.asarray(1e4, dtype)  # must not reach the output in either implementation

    def cache(key):
        return jnp.where(stale, garbage, jax.random.normal(key, cache_shape, dtype))  # [B, S, Kh, D]

    return dict(
        q=2.0 * jax.random.normal(keys[0], (batch, num_new, num_heads, head_dim), dtype),  # [B, T, H, D]
        cache_k=cache(keys[1]),
        cache_v=cache(keys[2]),
        prefix_lengths=prefix_lengths,
        tree_k=jax.random.normal(keys[3], (batch, num_new, num_kv_heads, head_dim), dtype),  # [B, T, Kh, D]
        tree_v=jax.random.normal(keys[4], (batch, num_new, num_kv_heads, head_dim), dtype),  # [B, T, Kh, D]
        tree_mask=jnp.asarray(tree_masks(rng, shape.tree, batch, num_new)),  # [B, T, T]
    )


def short_error(error: BaseException) -> str:
    """One line for a table cell: type and the first line of the message."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"[:160]


def max_abs_error(actual, expected) -> float:
    difference = np.abs(np.asarray(actual, np.float32) - np.asarray(expected, np.float32))
    return float(np.nan_to_num(difference, nan=np.inf).max())


def median_ms(fn, args: dict, repeats: int):
    """Median wall time of fn(**args) in milliseconds, after one warm-up call (which also compiles)."""
    out = jax.block_until_ready(fn(**args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(**args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), out


def run_checks(shapes, heads, kernel, reference, deadline) -> list[dict]:
    rows = []
    for index, shape in enumerate(shapes):
        for dtype_name in ("float32", "bfloat16"):
            row = dict(dataclasses.asdict(shape), dtype=dtype_name, max_abs_error=None, ok=False, error=None)
            rows.append(row)
            if time.monotonic() > deadline:
                row["error"] = "skipped: time budget spent"
                continue
            try:
                args = make_inputs(index, shape, heads, jnp.dtype(dtype_name))
                # Full-precision matmuls on both sides in float32 (XLA would use TF32 on this GPU),
                # so the comparison measures the kernel, not the matmul mode.
                with jax.default_matmul_precision("highest"):
                    expected = jax.block_until_ready(reference(**args))
                    actual = jax.block_until_ready(kernel(**args))
                row["max_abs_error"] = max_abs_error(actual, expected)
                row["ok"] = row["max_abs_error"] <= TOLERANCE[dtype_name]
            except Exception as error:  # noqa: BLE001  (report and carry on with the next shape)
                row["error"] = short_error(error)
                traceback.print_exc(limit=3)
    return rows


def run_timings(grid, heads, kernel, reference, repeats, deadline) -> list[dict]:
    rows = []
    for num_new, cache_length, batch in grid:
        row = dict(num_new=num_new, cache_length=cache_length, batch=batch, xla_ms=None, pallas_ms=None,
                   speedup=None, max_abs_error=None, error=None)
        rows.append(row)
        if time.monotonic() > deadline:
            row["error"] = "skipped: time budget spent"
            continue
        errors = []
        try:
            shape = Shape(batch, num_new, cache_length, tree="random", prefixes="full")
            args = make_inputs(num_new * 7919 + cache_length + batch, shape, heads, jnp.bfloat16)
        except Exception as error:  # noqa: BLE001
            row["error"] = "inputs: " + short_error(error)
            continue
        expected = actual = None
        try:
            row["xla_ms"], expected = median_ms(reference, args, repeats)
        except Exception as error:  # noqa: BLE001
            errors.append("xla: " + short_error(error))
        try:
            row["pallas_ms"], actual = median_ms(kernel, args, repeats)
        except Exception as error:  # noqa: BLE001
            errors.append("pallas: " + short_error(error))
            traceback.print_exc(limit=3)
        if row["xla_ms"] and row["pallas_ms"]:
            row["speedup"] = row["xla_ms"] / row["pallas_ms"]
        if expected is not None and actual is not None:
            row["max_abs_error"] = max_abs_error(actual, expected)
        row["error"] = "; ".join(errors) or None
        del args, expected, actual
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_checks(rows) -> None:
    print("\n## Correctness (kernel vs reference)\n")
    print("| B | T | S | tree | prefixes | dtype | max abs error | result |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        result = r["error"] or ("ok" if r["ok"] else f"FAIL (tolerance {TOLERANCE[r['dtype']]})")
        print(f"| {r['batch']} | {r['num_new']} | {r['cache_length']} | {r['tree']} | {r['prefixes']} | {r['dtype']} "
              f"| {fmt(r['max_abs_error'], '.2e')} | {result} |")


def print_timings(rows) -> None:
    print("\n## Timing (bfloat16, prefix = S - T, median ms)\n")
    print("| T | S | B | xla ms | pallas ms | speedup | max abs error | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_new']} | {r['cache_length']} | {r['batch']} | {fmt(r['xla_ms'], '.3f')} "
              f"| {fmt(r['pallas_ms'], '.3f')} | {fmt(r['speedup'], '.2f')} | {fmt(r['max_abs_error'], '.2e')} "
              f"| {r['error'] or ''} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allow-cpu", action="store_true", help="run even if the default backend is the CPU")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, Pallas interpret mode (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per shape (default 20; 3 with --quick)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop starting new shapes after this many seconds")
    parser.add_argument("--block-q", type=int, default=BlockSizes().block_q)
    parser.add_argument("--block-k", type=int, default=BlockSizes().block_k)
    parser.add_argument("--num-warps", type=int, default=BlockSizes().num_warps)
    parser.add_argument("--num-stages", type=int, default=BlockSizes().num_stages)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s

    backend = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    print(f"jax {jax.__version__}, backend {backend}, device {device_kind} (x{jax.device_count()})")
    if backend == "cpu" and not args.allow_cpu:
        print("The default backend is the CPU: this script checks the compiled GPU kernel. "
              "Run it on a GPU machine, or pass --allow-cpu (with --quick) for a smoke test.", file=sys.stderr)
        return 2

    block_sizes = BlockSizes(args.block_q, args.block_k, args.num_warps, args.num_stages)
    interpret = args.quick
    repeats = args.repeats or (3 if args.quick else 20)
    print(f"{block_sizes}, interpret={interpret}, repeats={repeats}")
    kernel = functools.partial(tree_attention, block_sizes=block_sizes, interpret=interpret)
    reference = jax.jit(tree_attention_reference)

    if args.quick:
        heads = QUICK_HEADS
        check_shapes = [Shape(2, 5, 40, "random", "ragged"), Shape(1, 1, 33, "chain", "ragged")]
        timing_grid = [(t, s, b) for t in (4, 16) for s in (32, 64) for b in (1, 2)]
    else:
        heads = FULL_HEADS
        check_shapes = [
            Shape(3, 37, 300, "random", "ragged"),  # neither T nor S a block multiple; prefixes 0, S, random
            Shape(2, 1, 1000, "chain", "ragged"),  # a decode step
            Shape(2, 128, 2048, "chain", "full"),
            Shape(1, 200, 4096, "star", "full"),
        ]
        timing_grid = [(t, s, b) for t in (16, 64, 128, 256, 512) for s in (1024, 2048, 4096, 8192) for b in (1, 4)]
    print(f"heads: {heads}")

    started = time.monotonic()
    checks = run_checks(check_shapes, heads, kernel, reference, deadline)
    print_checks(checks)
    timings = run_timings(timing_grid, heads, kernel, reference, repeats, deadline)
    print_timings(timings)
    print(f"\n{time.monotonic() - started:.0f} s for checks and timings")

    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(
            jax_version=jax.__version__, backend=backend, device_kind=device_kind, interpret=interpret,
            block_sizes=dataclasses.asdict(block_sizes), heads=heads, repeats=repeats,
            tolerance=TOLERANCE, checks=checks, timings=timings,
        ), indent=2))
        print(f"wrote {path}")
    failed = [c for c in checks if not c["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
