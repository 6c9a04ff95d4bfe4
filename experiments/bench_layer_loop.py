"""How to loop over layers on CPU: unrolled (what specjax uses) against `lax.scan` over stacked layers.

    python experiments/bench_layer_loop.py [--repeats 30] [--json out.json]

Three ways to run SmolLM2's 30 decoder layers for 1 and 16 new tokens with a 512-slot KV cache:
- unrolled: a Python loop, one params subtree and one cache array per layer (specjax's choice);
- scan, cache as xs: params and cache stacked on a leading layer axis and scanned; each layer's
  updated cache comes back as a scan output;
- scan, cache in carry: the stacked cache rides in the scan carry and each layer writes its slice
  with a dynamic update.
All three use the same DecoderLayer module, so only the loop differs. Only the cache is returned,
so XLA drops the LM head in all three alike: the times are for the 30 layers. Times are medians of
jitted calls with the cache donated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cache-length", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()

    from specjax.io.registry import load_model
    from specjax.models.cache import KVCache
    from specjax.models.layers import attention_mask, rope_tables
    from specjax.models.transformer import DecoderLayer, Transformer, forward

    model = load_model("smollm2")
    cfg, params = model.config, model.params
    layer = DecoderLayer(cfg)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"] for i in range(cfg.num_layers)])
    head = Transformer(cfg)

    def scan_forward(params, stacked, tokens, positions, keys, values, write_index, cache_in_carry):
        x = head.apply({"params": params}, tokens, method=Transformer.embed)
        cos, sin = rope_tables(cfg, positions)
        mask = attention_mask(write_index, tokens.shape[1], keys.shape[2], None)
        if cache_in_carry:
            def body(carry, xs):
                x, keys, values = carry
                layer_params, i = xs
                x, k, v = layer.apply({"params": layer_params}, x, cos, sin, keys[i], values[i], write_index, mask)
                return (x, keys.at[i].set(k), values.at[i].set(v)), None
            (x, keys, values), _ = jax.lax.scan(body, (x, keys, values), (stacked, jnp.arange(cfg.num_layers)))
        else:
            def body(x, xs):
                layer_params, k, v = xs
                x, k, v = layer.apply({"params": layer_params}, x, cos, sin, k, v, write_index, mask)
                return x, (k, v)
            x, (keys, values) = jax.lax.scan(body, x, (stacked, keys, values))
        logits = head.apply({"params": params}, x, method=Transformer.project_logits)
        return logits, keys, values

    def timed(fn, make_state, repeats):
        state = make_state()
        state = fn(*state)  # compile
        jax.block_until_ready(state)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            state = jax.block_until_ready(fn(*state))
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    results = {}
    for num_new in (1, 16):
        tokens = jnp.ones((1, num_new), jnp.int32)
        index = jnp.asarray([64], jnp.int32)
        positions = index[:, None] + jnp.arange(num_new)[None]

        @jax.jit
        def unrolled(cache):
            return (forward(params, cfg, tokens, positions, cache, index).cache,)

        unrolled = jax.jit(unrolled.__wrapped__, donate_argnums=0)
        shape = (cfg.num_layers, 1, args.cache_length, cfg.num_kv_heads, cfg.head_dim)

        def scanned(cache_in_carry):
            def step(keys, values):
                _, keys, values = scan_forward(params, stacked, tokens, positions, keys, values, index, cache_in_carry)
                return keys, values
            return jax.jit(step, donate_argnums=(0, 1))

        row = {
            "unrolled": timed(unrolled, lambda: (KVCache.zeros(cfg, 1, args.cache_length),), args.repeats),
            "scan_cache_as_xs": timed(scanned(False), lambda: (jnp.zeros(shape), jnp.zeros(shape)), args.repeats),
            "scan_cache_in_carry": timed(scanned(True), lambda: (jnp.zeros(shape), jnp.zeros(shape)), args.repeats),
        }
        results[f"{num_new}_new_tokens_ms"] = row
        print(num_new, "new tokens:", {k: round(v, 1) for k, v in row.items()}, flush=True)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
