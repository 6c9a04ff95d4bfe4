"""The verify-cost curve: a target's forward at T = 1..64 new tokens, float32 against bf16 compute.

    python experiments/verify_cost_curve.py [--shape smollm2] [--repeats 20] [--cache-length 256] [--json out.json]

--shape smollm2 times the real SmolLM2-135M. llama-3.2-1b and llama-3.1-8b time random weights of
those models' shapes (timing needs no trained weights), and toy a 2-layer model for dry runs.

For each compute dtype, the model's params are cast to it and `forward` runs T new tokens written at
slot 100 of a `cache-length` KV cache (of the same dtype), the LM head on every new token, as a
verify pass does. bf16 means bf16 weights, activations into every dot and KV cache, with float32
accumulation (`models/layers.py:accumulate_in_float32`; single rows padded to two) and float32 norms,
softmax and RoPE. Times are medians of jitted calls, measured side by side in one process, with the
cache donated. The ratio column is each T against T=1 of the same dtype; `vs fastest step` is against
the fastest 1-token step of either dtype, which is what a speculative step has to beat.

With --tree-packing, each dtype also times a tree-shaped pass at T = 4, 8, 16 and 32 (a random tree,
each node's parent drawn from the nodes before it) twice, side by side: with the ancestor mask alone,
and with the visible tokens packed at AR's slots (`forward(pack_visible=True)`, what `verify_tree`
runs so trees round as AR does). The packed column's ratio is that exactness's price.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp

SIZES = (1, 2, 4, 8, 16, 32, 64)
# Shapes from the models' published config.json files (Llama-3.2-1B, Llama-3.1-8B).
RANDOM_SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                         head_dim=64, intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, intermediate_size=14336, rope_theta=500000.0, tie_word_embeddings=False),
    "toy": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=128),
}
TREE_SIZES = (4, 8, 16, 32)


def random_tree_mask(num_new: int, seed: int = 0):
    """[1, T, T] ancestor-or-self mask of a random tree whose parents precede their children."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mask = np.eye(num_new, dtype=bool)
    for node in range(1, num_new):
        mask[node] |= mask[int(rng.integers(0, node))]
    return jnp.asarray(mask[None])


def median_ms(step, params, cache, repeats, *args):
    """Median wall time of `repeats` calls of step(params, cache, *args) -> (logits, cache), cache donated."""
    logits, cache = jax.block_until_ready(step(params, cache, *args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits, cache = jax.block_until_ready(step(params, cache, *args))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def target(shape: str, dtype: str):
    """(params, config) of the named shape at compute dtype `dtype`: SmolLM2's trained weights, or
    random ones made on the device at that dtype (an 8B model in float32 is 32 GB)."""
    from specjax.models.config import TransformerConfig
    from specjax.models.transformer import init_params

    if shape == "smollm2":
        from specjax.io.registry import load_model

        base = load_model("smollm2")
        return jax.tree.map(lambda a: a.astype(dtype), base.params), dataclasses.replace(base.config, dtype=dtype)
    config = TransformerConfig(**RANDOM_SHAPES[shape], dtype=dtype)
    make = jax.jit(lambda rng: jax.tree.map(lambda a: (0.02 * a).astype(dtype), init_params(config, rng)))
    return make(jax.random.key(0)), config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("smollm2", *RANDOM_SHAPES), default="smollm2")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated T values")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cache-length", type=int, default=256)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tree-packing", action="store_true", help="also time tree passes, packed and plain")
    parser.add_argument("--json")
    args = parser.parse_args()

    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    sizes = tuple(int(t) for t in args.sizes.split(","))
    if 1 not in sizes:
        raise SystemExit("--sizes must include 1: every ratio is against a one-token step")
    results: dict[str, dict[int, float]] = {}
    tree_results: dict[str, dict[int, dict[str, float]]] = {}
    for dtype in args.dtypes.split(","):
        params, config = target(args.shape, dtype)

        @jax.jit
        def step(params, cache, tokens, positions, write_index):
            out = forward(params, config, tokens, positions, cache, write_index)
            return out.logits, out.cache

        @partial(jax.jit, static_argnames="pack")
        def tree_step(params, cache, tokens, positions, write_index, mask, pack):
            out = forward(params, config, tokens, positions, cache, write_index, block_mask=mask, pack_visible=pack)
            return out.logits, out.cache

        results[dtype] = {}
        write_index = jnp.asarray([100], jnp.int32)
        for num_new in sizes:
            tokens = jnp.ones((1, num_new), jnp.int32)
            positions = write_index[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None]
            cache = KVCache.zeros(config, 1, args.cache_length)
            results[dtype][num_new] = median_ms(step, params, cache, args.repeats, tokens, positions, write_index)
            print(f"{dtype:9s} T={num_new:3d} {results[dtype][num_new]:7.1f} ms", flush=True)
        if args.tree_packing:
            tree_results[dtype] = {}
            for num_new in TREE_SIZES:
                mask = random_tree_mask(num_new)
                tokens = jnp.ones((1, num_new), jnp.int32)
                positions = write_index[:, None] + jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1  # 100 + depth
                row = {}
                for pack in (False, True):
                    cache = KVCache.zeros(config, 1, args.cache_length)
                    row["packed" if pack else "plain"] = median_ms(tree_step, params, cache, args.repeats, tokens,
                                                                   positions, write_index, mask, pack)
                tree_results[dtype][num_new] = row
                print(f"{dtype:9s} tree T={num_new:3d} plain {row['plain']:7.1f} ms, packed {row['packed']:7.1f} ms",
                      flush=True)

    fastest_step = min(r[1] for r in results.values())
    print("\n| T | " + " | ".join(f"{d} ms | {d} / its T=1" for d in results) + " | fastest dtype at T / fastest 1-token step |")
    print("|---|" + "---|---|" * len(results) + "---|")
    for num_new in sizes:
        cells = " | ".join(f"{r[num_new]:.1f} | {r[num_new] / r[1]:.2f}x" for r in results.values())
        best = min(r[num_new] for r in results.values())
        print(f"| {num_new} | {cells} | {best / fastest_step:.2f}x |")
    if tree_results:
        print("\n| tree T | " + " | ".join(f"{d} plain ms | {d} packed ms | packed / plain" for d in tree_results) + " |")
        print("|---|" + "---|---|---|" * len(tree_results))
        for num_new in TREE_SIZES:
            cells = " | ".join(f"{r[num_new]['plain']:.1f} | {r[num_new]['packed']:.1f} | "
                               f"{r[num_new]['packed'] / r[num_new]['plain']:.2f}x" for r in tree_results.values())
            print(f"| {num_new} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": str(jax.devices()[0].device_kind), "cache_length": args.cache_length, "repeats": args.repeats,
                       "ms": {d: {str(t): v for t, v in r.items()} for d, r in results.items()},
                       "tree_ms": {d: {str(t): v for t, v in r.items()} for d, r in tree_results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
