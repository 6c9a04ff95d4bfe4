"""How XLA:CPU writes and reads a bf16 KV cache (issue 14, item 5: the generator's cache copy).

    python experiments/bf16_cache_forms.py [--rows 128] [--slots 256]

SmolLM2's KV shapes ([rows, slots, 3, 64] per layer, 30 layers; K and V), timed per form:
  writes, one token per row, into every layer's K and V buffer, the buffers donated:
    - a per-row write (vmap of dynamic_update_slice, what `cache.write_rows` does), into a uint16 buffer
      holding bf16 bits (the project's storage) and into a bf16 buffer;
    - one slot for every row (a plain dynamic_update_slice), bf16 buffer, written as bf16 and through
      its bits;
  reads, one layer, the stacked-heads attention of a one-token step (`layers.stacked_heads_attention`)
    over a bf16 buffer and over a uint16 buffer bitcast back to bf16.
Medians of 10 calls after a warm-up call.
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

    from specjax.models.layers import stacked_heads_attention

    rows, slots, kv_heads, head_dim, heads = args.rows, args.slots, 3, 64, 9
    buffers = 2 * args.layers
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
    bf16 = lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16)  # noqa: E731
    starts = jnp.asarray(np.random.default_rng(0).integers(0, slots, rows), jnp.int32)

    def per_row(buffer, new, start):
        return jax.vmap(lambda r, n, s: jax.lax.dynamic_update_slice_in_dim(r, n, s, 0))(buffer, new, start)

    writes = {
        "per-row write, uint16 bits buffer": (jnp.uint16, lambda b, n, s: per_row(b, bits(n), s)),
        "per-row write, bf16 buffer": (jnp.bfloat16, per_row),
        "one slot for every row, bf16 buffer": (
            jnp.bfloat16, lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s[0], 1)),
        "one slot for every row, bf16 buffer through its bits": (
            jnp.bfloat16, lambda b, n, s: bf16(jax.lax.dynamic_update_slice_in_dim(bits(b), bits(n), s[0], 1))),
    }
    print(f"| form | ms for {buffers} buffers of [{rows}, {slots}, {kv_heads}, {head_dim}] |\n|---|---|")
    for name, (dtype, write) in writes.items():
        step = jax.jit(lambda bs, n, s, write=write: [write(b, n, s) for b in bs], donate_argnums=0)
        state = [jnp.zeros((rows, slots, kv_heads, head_dim), dtype) for _ in range(buffers)]
        new = jnp.ones((rows, 1, kv_heads, head_dim), jnp.bfloat16)
        state = jax.block_until_ready(step(state, new, starts))
        seconds = []
        for _ in range(10):
            start = time.perf_counter()
            state = jax.block_until_ready(step(state, new, starts))
            seconds.append(time.perf_counter() - start)
        print(f"| {name} | {np.median(seconds) * 1e3:.2f} |")

    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.standard_normal((rows, slots, kv_heads, head_dim)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((rows, 1, heads, head_dim)), jnp.bfloat16)
    mask = jnp.ones((rows, 1, slots), bool)
    reads = {"bf16 buffer": (k, v, lambda x: x), "uint16 bits, bitcast back": (bits(k), bits(v), bf16)}
    print("\n| attention of one token per row over | ms a layer |\n|---|---|")
    for name, (keys, values, view) in reads.items():
        attend = jax.jit(lambda kk, vv, view=view: stacked_heads_attention(q, view(kk), view(vv), mask))
        jax.block_until_ready(attend(keys, values))
        seconds = []
        for _ in range(10):
            start = time.perf_counter()
            jax.block_until_ready(attend(keys, values))
            seconds.append(time.perf_counter() - start)
        print(f"| {name} | {np.median(seconds) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
