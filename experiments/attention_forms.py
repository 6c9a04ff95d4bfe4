"""The two forms of the model's grouped-query attention over a KV cache, timed side by side:
the per-head einsums (`grouped_query_attention`'s default) against the stacked-heads form
(`stacked_heads_attention`), for SmolLM2's heads (9 query, 3 KV, head_dim 64) at several row
counts, new-token counts and cache lengths, in float32 and bf16. One layer, jitted, median of
`--repeats` calls; the largest difference between the two outputs is printed beside the times.
This is the measurement behind `models/layers.py:stacked_heads_pays`.

    python experiments/attention_forms.py [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

CASES = ((1, 1, 256), (1, 16, 256), (8, 1, 512), (16, 1, 256), (32, 1, 512), (64, 1, 256), (128, 1, 256),
         (8, 16, 512), (32, 16, 512))


def timed(fn, args, repeats):
    fn = jax.jit(fn)
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), out


def main():
    from specjax.models.layers import per_head_attention, stacked_heads_attention, stacked_heads_pays

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    heads, kv_heads, dim = 9, 3, 64
    rows = []
    print("| rows | new tokens | cache slots | dtype | per-head ms | stacked ms | per-head / stacked | "
          "largest difference | stacked chosen |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch, num_new, slots in CASES:
        for dtype in (jnp.float32, jnp.bfloat16):
            keys = jax.random.split(jax.random.key(batch * 1000 + num_new), 3)
            q = jax.random.normal(keys[0], (batch, num_new, heads, dim), dtype)
            k = jax.random.normal(keys[1], (batch, slots, kv_heads, dim), dtype)
            v = jax.random.normal(keys[2], (batch, slots, kv_heads, dim), dtype)
            mask = jnp.ones((batch, num_new, slots), bool)
            base_ms, base = timed(per_head_attention, (q, k, v, mask), args.repeats)
            stacked_ms, stacked = timed(stacked_heads_attention, (q, k, v, mask), args.repeats)
            diff = float(jnp.max(jnp.abs(base.astype(jnp.float32) - stacked.astype(jnp.float32))))
            chosen = stacked_heads_pays(batch, num_new, kv_heads)
            rows.append(dict(rows=batch, new_tokens=num_new, slots=slots, dtype=jnp.dtype(dtype).name,
                             per_head_ms=base_ms, stacked_ms=stacked_ms, max_difference=diff, stacked_chosen=chosen))
            print(f"| {batch} | {num_new} | {slots} | {jnp.dtype(dtype).name} | {base_ms:.2f} | {stacked_ms:.2f} | "
                  f"{base_ms / stacked_ms:.2f}x | {diff:.1e} | {'yes' if chosen else 'no'} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
