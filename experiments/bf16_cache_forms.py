"""How XLA:CPU writes and reads a bf16 KV cache (issue 14, item 5: the generator's cache copy).

    python experiments/bf16_cache_forms.py [--rows 128] [--slots 256]

SmolLM2's KV shapes ([rows, slots, 3, 64] per layer, 30 layers; K and V), timed per form:
  writes, one token per row, into every layer's K and V buffer, the buffers donated:
    - a per-row write (vmap of dynamic_update_slice, what `cache.write_rows` does), into a uint16 buffer
      holding bf16 bits (the project's storage) and into a bf16 buffer;
    - one slot for every row (a plain dynamic_update_slice), bf16 buffer, written as bf16 and through
      its bits;
  reads, one layer, the stacked-heads attention of a one-token step (`layers.stacked_heads_attention`)
    over a bf16 buffer and over a uint16 buffer bitcast back to bf16;
  the read bound, every layer's K buffer (uint16 bits) in one program: the score product of one query
    token per row as the model's batched bf16 dot and as a float32 einsum that XLA can fuse with the
    bits' conversion, the value product as the batched dot, and plain reads (sums of the cache
    converted to float32, over slots or over the contiguous head_dim, and of the bits as integers),
    the least work any form of attention must do, which bounds every form XLA:CPU can emit; with
    numpy's float32 sum over as many elements for comparison.
Medians of 10 calls after a warm-up call (5 for the read bound; `decode.budget.median_seconds`).
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

    from specjax.decode.budget import median_seconds
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
        print(f"| {name} | {median_seconds(10, lambda: attend(keys, values)) * 1e3:.2f} |")

    read_bound(rows, slots, kv_heads, head_dim, args.layers)


def read_bound(rows: int, slots: int, kv_heads: int, head_dim: int, layers: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.decode.budget import median_seconds

    group = 3  # SmolLM2's query heads per KV head
    rng = np.random.default_rng(0)
    bf16 = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.bfloat16)  # noqa: E731
    caches = [jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((rows, slots, kv_heads, head_dim)),
                                                       jnp.bfloat16), jnp.uint16) for _ in range(layers)]
    query = jnp.asarray(rng.standard_normal((rows, kv_heads, group, head_dim)), jnp.float32)  # [B, K, G, D]
    probs = jnp.asarray(rng.random((rows, kv_heads, group, slots)), jnp.float32)  # [B, K, G, S]
    as_float = lambda c: bf16(c).astype(jnp.float32)  # noqa: E731
    forms = {
        "scores, the batched bf16 dot the model uses": (query, lambda q, c: jnp.einsum(
            "BKGD,BSKD->BKGS", q.astype(jnp.bfloat16), bf16(c), preferred_element_type=jnp.float32)),
        "scores, a float32 einsum over the converted bits": (query, lambda q, c: jnp.einsum(
            "BKGD,BSKD->BSKG", q, as_float(c))),
        "values, the batched bf16 dot the model uses": (probs, lambda p, c: jnp.einsum(
            "BKGS,BSKD->BKGD", p.astype(jnp.bfloat16), bf16(c), preferred_element_type=jnp.float32)),
        "a plain read: sum over slots in float32": (query, lambda q, c: jnp.sum(as_float(c), axis=1)),
        "a plain read: sum over the contiguous head_dim in float32": (query, lambda q, c: jnp.sum(as_float(c), -1)),
        "a plain read of the bits as integers": (query, lambda q, c: jnp.sum(c.astype(jnp.int32), axis=-1)),
    }
    cache_bytes = rows * slots * kv_heads * head_dim * 2 * layers
    print(f"\n| read bound over {layers} layers of K ({cache_bytes / 2**20:.0f} MiB) | ms | GB/s of cache read |"
          "\n|---|---|---|")
    for name, (operand, form) in forms.items():
        run = jax.jit(lambda x, cs, form=form: [form(x, c) for c in cs])
        seconds = median_seconds(5, lambda: run(operand, caches))
        print(f"| {name} | {seconds * 1e3:.1f} | {cache_bytes / seconds / 1e9:.1f} |")
    same_count = np.ones((rows, slots, kv_heads, head_dim * layers), np.float32)
    seconds = median_seconds(5, lambda: same_count.sum(axis=-1))
    print(f"| numpy, float32 sum over the last axis of as many elements | {seconds * 1e3:.1f} | "
          f"{same_count.nbytes / seconds / 1e9:.1f} (float32 bytes) |")


if __name__ == "__main__":
    main()
