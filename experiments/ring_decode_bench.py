"""Autoregressive decode speed of a sliding-window model at long context: sliding layers with KV
rings (window + 1 - 1 slots, how the Engine decodes autoregressively) against one slot per position.

    python experiments/ring_decode_bench.py [--contexts 1024,4096,8192] [--window 256] [--new 32]

No sliding-window model is on this machine, so the model is SmolLM2-135M with every layer made to
slide over --window keys (Mistral-style). Its tokens are not SmolLM2's, but the cost of a decode
step is that of a real 30-layer model. Both variants decode the same prompt to the same tokens
(checked). The prefill is timed apart from the decode loop. Each timing is the median of --repeats
runs of the compiled executable, with the two variants run in turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from specjax.decode.autoregressive import continue_autoregressive, start_autoregressive  # noqa: E402
from specjax.decode.sampling import SamplingConfig  # noqa: E402
from specjax.io.registry import load_model  # noqa: E402
from specjax.decode.memory import target_kv_bytes  # noqa: E402

STATICS = ("config", "sampling", "max_new_tokens", "eos_token_ids", "cache_length")


@partial(jax.jit, static_argnames=STATICS)
def _prefill(params, tokens, lengths, rng, **statics):
    return start_autoregressive(params, tokens, lengths, rng, **statics)


@partial(jax.jit, static_argnames=("config", "sampling", "eos_token_ids", "until"))
def _decode(params, state, *, config, sampling, eos_token_ids, until):
    return continue_autoregressive(params, state, until, config=config, sampling=sampling, eos_token_ids=eos_token_ids)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--new", type=int, default=32, help="tokens decoded after the prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    model = load_model("smollm2")
    sliding = dataclasses.replace(model.config, sliding_window=args.window, max_position_embeddings=1 << 20)
    variants = {"one slot per position": sliding, "rings": sliding.with_kv_rings(1)}
    rng = np.random.default_rng(0)
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        prompt_len = context - args.new
        tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, size=(1, prompt_len)), jnp.int32)
        lengths = jnp.asarray([prompt_len], jnp.int32)
        cache_length = -(-context // 64) * 64
        common = dict(sampling=SamplingConfig(), eos_token_ids=())
        timings, outputs, row = {name: [] for name in variants}, {}, {"context": context}
        for _ in range(args.repeats):
            for name, config in variants.items():
                state = _prefill(model.params, tokens, lengths, jax.random.key(0), config=config,
                                 max_new_tokens=args.new, cache_length=cache_length, **common)
                jax.block_until_ready(state)
                start = time.perf_counter()
                state = jax.block_until_ready(_decode(model.params, state, config=config, until=args.new, **common))
                timings[name].append(time.perf_counter() - start)
                outputs[name] = np.asarray(state.tokens)[0, : int(state.num_generated[0])].tolist()
        for name, config in variants.items():
            row[f"{name} ms/token"] = 1000 * statistics.median(timings[name][1:] or timings[name]) / (args.new - 1)
            row[f"{name} KV MiB"] = target_kv_bytes(config, 1, cache_length) / 2**20
        row["speedup"] = row["one slot per position ms/token"] / row["rings ms/token"]
        row["same tokens"] = outputs["rings"] == outputs["one slot per position"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| context | ms/token, one slot per position | ms/token, rings | speedup | KV MiB, one slot per position "
          "| KV MiB, rings | same tokens |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['one slot per position ms/token']:.1f} | {r['rings ms/token']:.1f} | "
              f"{r['speedup']:.2f}x | {r['one slot per position KV MiB']:.0f} | {r['rings KV MiB']:.1f} | "
              f"{'yes' if r['same tokens'] else 'NO'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"window": args.window, "new": args.new, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
