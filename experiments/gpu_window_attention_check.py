"""GPU check of the Pallas windowed-attention kernels (forward and backward): do they compile, are they
right, and how do they compare with XLA and with the chip?

    python experiments/gpu_window_attention_check.py [--json PATH] [--repeats 10] [--budget-s 240]
    python experiments/gpu_window_attention_check.py --allow-cpu --quick     # tiny shapes, interpret mode

Meant for one short session on a GPU machine (jax with CUDA; no network needed):
1. correctness: compile forward and backward (Triton) and compare output, log-sum-exp and the q/k/v
   gradients with the jnp reference, float32 and bfloat16, sliding windows smaller and larger than
   the sequence, ragged lengths;
2. timing: SmolLM2-135M heads (H=9, Kh=3, D=64), bfloat16, batch 1, causal sliding windows of
   256..4096 over sequences of 2k..32k: the kernel's forward and forward+backward against XLA's
   dense masked attention (the reference), median of --repeats calls, with the kernel's achieved
   TFLOP/s (useful FLOPs of the window only) next to the chip's peak (--peak-tflops).

Shapes run in their own try blocks (an XLA out-of-memory at 32k is a row, not a crash) under a time
budget counted from the start. Imports only jax, numpy and specjax.pallas_kernels.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from gpu_tree_attention_check import fmt, max_abs_error, median_ms, short_error  # noqa: E402
from specjax.pallas_kernels.window_attention import (  # noqa: E402
    AttentionScores,
    BlockSizes,
    sliding_window_ranges,
    window_attention,
    window_attention_reference,
)

FULL_HEADS = dict(num_heads=9, num_kv_heads=3, head_dim=64)
QUICK_HEADS = dict(num_heads=6, num_kv_heads=3, head_dim=16)
TOLERANCE = {"float32": 2e-4, "bfloat16": 5e-2}  # relative to the largest magnitude of the compared array


def make_inputs(seed, batch, length, window, heads, dtype, ragged=False):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)  # noqa: E731
    q = 2.0 * normal(batch, length, heads["num_heads"], heads["head_dim"])
    k = normal(batch, length, heads["num_kv_heads"], heads["head_dim"])
    v = normal(batch, length, heads["num_kv_heads"], heads["head_dim"])
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    lengths = jnp.asarray(rng.integers(length // 2, length + 1, size=batch), jnp.int32) if ragged else None
    starts, ends = sliding_window_ranges(positions, window, lengths)
    return q, k, v, starts, ends


def relative_error(actual, expected) -> float:
    scale = float(np.max(np.abs(np.asarray(expected, np.float32)))) or 1.0
    return max_abs_error(actual, expected) / scale


def run_checks(cases, heads, block_sizes, deadline):
    rows = []
    for index, (batch, length, window, ragged, softcap) in enumerate(cases):
        # A soft-capped case (Gemma 2's logits) exercises tanh and its derivative inside the kernels.
        scores = AttentionScores() if softcap is None else AttentionScores(scale=0.0625, softcap=softcap)
        for dtype_name in ("float32", "bfloat16"):
            row = dict(batch=batch, length=length, window=window, ragged=ragged, softcap=softcap, dtype=dtype_name,
                       errors=None, ok=False, error=None)
            rows.append(row)
            if time.monotonic() > deadline:
                row["error"] = "skipped: time budget spent"
                continue
            try:
                q, k, v, starts, ends = make_inputs(index, batch, length, window, heads, jnp.dtype(dtype_name), ragged)
                probe = jnp.asarray(np.random.default_rng(99).standard_normal(q.shape), jnp.float32)

                def loss(attention):
                    def f(q, k, v):
                        out, lse = attention(q, k, v, starts, ends)
                        return jnp.sum(out.astype(jnp.float32) * probe) + 0.1 * jnp.sum(jnp.where(lse > -1e30, lse, 0))
                    return f

                kernel = lambda *a: window_attention(*a, block_sizes=block_sizes, scores=scores)  # noqa: E731
                reference = lambda *a: window_attention_reference(*a, scores)  # noqa: E731
                with jax.default_matmul_precision("highest"):
                    expected = jax.block_until_ready(reference(q, k, v, starts, ends))
                    actual = jax.block_until_ready(kernel(q, k, v, starts, ends))
                    grads_expected = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
                    grads_actual = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
                errors = {"out": relative_error(actual[0], expected[0]), "lse": relative_error(actual[1], expected[1])}
                for name, a, e in zip(("dq", "dk", "dv"), grads_actual, grads_expected):
                    errors[name] = relative_error(a, e)
                row["errors"] = errors
                row["ok"] = max(errors.values()) <= TOLERANCE[dtype_name]
            except Exception as error:  # noqa: BLE001
                row["error"] = short_error(error)
                traceback.print_exc(limit=3)
    return rows


def run_timings(grid, heads, block_sizes, repeats, deadline):
    rows = []
    for length, window in grid:
        row = dict(length=length, window=window, xla_fwd_ms=None, pallas_fwd_ms=None, xla_fwdbwd_ms=None,
                   pallas_fwdbwd_ms=None, pallas_fwd_tflops=None, error=None)
        rows.append(row)
        if time.monotonic() > deadline:
            row["error"] = "skipped: time budget spent"
            continue
        errors = []
        q, k, v, starts, ends = make_inputs(length + window, 1, length, window, heads, jnp.bfloat16)
        args = dict(q=q, k=k, v=v)
        kernel = jax.jit(lambda q, k, v: window_attention(q, k, v, starts, ends, block_sizes=block_sizes))
        xla = jax.jit(lambda q, k, v: window_attention_reference(q, k, v, starts, ends))
        def grad_of(f):
            grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0].astype(jnp.float32)), argnums=(0, 1, 2)))
            return lambda q, k, v: grads(q, k, v)  # median_ms passes keywords
        for name, fn in (("pallas_fwd_ms", kernel), ("xla_fwd_ms", xla), ("pallas_fwdbwd_ms", grad_of(kernel)),
                         ("xla_fwdbwd_ms", grad_of(xla))):
            if time.monotonic() > deadline:
                errors.append(f"{name}: skipped")
                continue
            try:
                row[name], _ = median_ms(fn, args, repeats)
            except Exception as error:  # noqa: BLE001
                errors.append(f"{name[:-3]}: " + short_error(error))
        if row["pallas_fwd_ms"]:
            visible = float(jnp.sum(jnp.maximum(ends - starts, 0)))  # query-key pairs in the window
            flops = 4.0 * visible * heads["num_heads"] * heads["head_dim"]  # QK^T and PV, 2 flops per MAC
            row["pallas_fwd_tflops"] = flops / (row["pallas_fwd_ms"] * 1e-3) / 1e12
        row["error"] = "; ".join(errors) or None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allow-cpu", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, Pallas interpret mode (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per shape (default 10; 2 with --quick)")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--block-q", type=int, default=BlockSizes().block_q)
    parser.add_argument("--block-k", type=int, default=BlockSizes().block_k)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the chip's dense bf16 peak, for the table (H200 SXM: 989)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    start = time.monotonic()
    deadline = start + args.budget_s
    print(f"jax {jax.__version__}; default backend {jax.default_backend()}; devices {jax.devices()}")
    if jax.default_backend() == "cpu" and not args.allow_cpu:
        print("no GPU: pass --allow-cpu (with --quick) to smoke-test in interpret mode", file=sys.stderr)
        return 2
    heads = QUICK_HEADS if args.quick else FULL_HEADS
    block_sizes = BlockSizes(block_q=args.block_q, block_k=args.block_k)
    repeats = args.repeats or (2 if args.quick else 10)
    if args.quick:
        cases = [(2, 40, 8, True, None), (1, 33, 100, False, 5.0)]
        grid = [(64, 16)]
    else:
        cases = [(2, 1000, 128, True, None), (1, 2048, 4096, False, None), (2, 777, 64, False, None),
                 (1, 1000, 256, False, 5.0)]
        grid = [(n, w) for n in (2048, 8192, 32768) for w in (256, 1024, 4096) if w < n]
    checks = run_checks(cases, heads, block_sizes, deadline)
    print("\n## Correctness (kernels vs reference; errors relative to the largest magnitude)\n")
    print("| B | T | window | ragged | soft cap | dtype | out | lse | dq | dk | dv | result |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in checks:
        e = r["errors"] or {}
        result = r["error"] or ("ok" if r["ok"] else f"FAIL (tolerance {TOLERANCE[r['dtype']]})")
        print(f"| {r['batch']} | {r['length']} | {r['window']} | {r['ragged']} | {r['softcap'] or '-'} | {r['dtype']} | "
              + " | ".join(fmt(e.get(n), ".1e") for n in ("out", "lse", "dq", "dk", "dv")) + f" | {result} |")
    timings = run_timings(grid, heads, block_sizes, repeats, deadline)
    print(f"\n## Timing (bfloat16, batch 1, H={heads['num_heads']} Kh={heads['num_kv_heads']} D={heads['head_dim']}, "
          f"causal sliding window, median of {repeats}; "
          f"chip peak {args.peak_tflops:.0f} TFLOP/s)\n")
    print("| sequence | window | xla fwd ms | pallas fwd ms | fwd speedup | xla fwd+bwd ms | pallas fwd+bwd ms | "
          "fwd+bwd speedup | pallas fwd TFLOP/s (% of peak) | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in timings:
        ratio = lambda a, b: None if not (r[a] and r[b]) else r[a] / r[b]  # noqa: E731
        tflops = r["pallas_fwd_tflops"]
        share = "-" if tflops is None else f"{tflops:.1f} ({100 * tflops / args.peak_tflops:.1f}%)"
        print(f"| {r['length']} | {r['window']} | {fmt(r['xla_fwd_ms'], '.3f')} | {fmt(r['pallas_fwd_ms'], '.3f')} | "
              f"{fmt(ratio('xla_fwd_ms', 'pallas_fwd_ms'), '.2f')} | {fmt(r['xla_fwdbwd_ms'], '.3f')} | "
              f"{fmt(r['pallas_fwdbwd_ms'], '.3f')} | {fmt(ratio('xla_fwdbwd_ms', 'pallas_fwdbwd_ms'), '.2f')} | "
              f"{share} | {r['error'] or ''} |")
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"jax": jax.__version__, "device": str(jax.devices()[0]),
                                                       "checks": checks, "timings": timings}, indent=1))
    return 0 if all(r["ok"] for r in checks if not r["error"]) else 1


if __name__ == "__main__":
    sys.exit(main())
