"""How fast XLA:CPU reads a generator step's KV cache, whatever the attention form (issue 14, item 5).

    python experiments/cache_read_bound.py [--rows 128] [--slots 256]

The self-distillation generator's step spends most of its time in attention over the cache
(BENCHMARKS.md, "Where the generator's time goes"). This times, for SmolLM2's 30 layers of
[rows, slots, 3 KV heads, 64] bf16 caches stored as uint16 bits (models/cache.py), jitted over all
layers in one program:
  - the score product of one query token per row, as the batched dot the model uses and as an
    einsum in float32 that XLA can fuse with the bits' conversion;
  - the value product, as the batched dot;
  - plain reads: sums of the cache converted to float32 (over slots, or over the contiguous
    head_dim), and of its bits as integers, the least work any form of attention must do, which
    bound every form XLA:CPU can emit.
Medians of 5 calls after a warm-up; GB/s counts the cache bytes each form reads.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    rows, slots, kv_heads, group, head_dim = args.rows, args.slots, 3, 3, 64
    rng = np.random.default_rng(0)
    as_bits = lambda x: jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16)  # noqa: E731
    caches = [as_bits(rng.standard_normal((rows, slots, kv_heads, head_dim))) for _ in range(args.layers)]
    query = jnp.asarray(rng.standard_normal((rows, kv_heads, group, head_dim)), jnp.float32)  # [B, K, G, D]
    probs = jnp.asarray(rng.random((rows, kv_heads, group, slots)), jnp.float32)  # [B, K, G, S]
    bf16 = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.bfloat16)  # noqa: E731
    forms = {
        "scores, batched bf16 dot (the model's form)": (query, lambda q, c: jnp.einsum(
            "BKGD,BSKD->BKGS", q.astype(jnp.bfloat16), bf16(c), preferred_element_type=jnp.float32)),
        "scores, float32 einsum over the converted bits": (query, lambda q, c: jnp.einsum(
            "BKGD,BSKD->BSKG", q, bf16(c).astype(jnp.float32))),
        "values, batched bf16 dot (the model's form)": (probs, lambda p, c: jnp.einsum(
            "BKGS,BSKD->BKGD", p.astype(jnp.bfloat16), bf16(c), preferred_element_type=jnp.float32)),
        "a plain read: sum over slots in float32": (query, lambda q, c: jnp.sum(bf16(c).astype(jnp.float32), axis=1)),
        "a plain read: sum over the contiguous head_dim in float32": (query, lambda q, c: jnp.sum(
            bf16(c).astype(jnp.float32), axis=-1)),
        "a plain read of the uint16 bits as integers": (query, lambda q, c: jnp.sum(c.astype(jnp.int32), axis=-1)),
    }
    cache_bytes = rows * slots * kv_heads * head_dim * 2 * args.layers
    print(f"{rows} rows x {slots} slots, {args.layers} layers: {cache_bytes / 2**20:.0f} MiB of K (or V) cache a step\n")
    print("| form | ms for all layers | GB/s of cache read |\n|---|---|---|")
    for name, (operand, form) in forms.items():
        run = jax.jit(lambda x, cs, form=form: [form(x, c) for c in cs])
        jax.block_until_ready(run(operand, caches))
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(run(operand, caches))
            seconds.append(time.perf_counter() - start)
        median = float(np.median(seconds))
        print(f"| {name} | {median * 1e3:.1f} | {cache_bytes / median / 1e9:.1f} |")


if __name__ == "__main__":
    main()
