"""How few query rows can bf16 decode steps be padded to and still give AR's output bit for bit?

    python experiments/query_rows_probe.py [--rows 4,8,16] [--prompts 6] [--max-new-tokens 64]

bf16 speculative output equals bf16 AR by construction when every decode-time forward runs the same
W query rows (TransformerConfig.query_rows): a 1-token step and a W-token verify pass then share all
shapes. W = 16 (the v3 drafter's block) costs an AR step about 1.33x an unpadded one here. A smaller W
costs AR less, but verify passes larger than W have shapes no AR step has. This probe measures both
sides on SmolLM2 with the committed drafter, batch 1, held-out chat prompts, all side by side:

1. logits: for each W, one token at a time through the padded model against one pass of 8 and of
   16 tokens: rows whose logits are not bitwise equal (0 everywhere means a 16-node verify is
   exact against AR padded to W on this backend, by measurement rather than by construction);
2. decoding: AR unpadded and padded to each W, trees of W nodes (the largest a W-padded target
   verifies by construction) and chains (which verify W - 1 drafts where W is under the block,
   slots.method_within_query_rows), with tokens/s, tau and whether each output equals AR padded
   to the same W.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np


def rows_differing(model, prompt: list[int], extra: list[int], pass_sizes: tuple[int, ...]) -> dict[int, int]:
    """Rows of each pass of n new tokens whose logits differ from the same tokens fed one at a time."""
    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    cfg = model.config
    run = jax.jit(lambda params, c, t, pos, at: forward(params, cfg, t, pos, c, at))
    length = len(prompt)
    cache = run(model.params, KVCache.zeros(cfg, 1, 256), jnp.asarray([prompt]), jnp.arange(length)[None],
                jnp.asarray([0])).cache
    steps, step_cache = [], cache
    for i, token in enumerate(extra):
        one = run(model.params, step_cache, jnp.asarray([[token]]), jnp.asarray([[length + i]]),
                  jnp.asarray([length + i]))
        step_cache = one.cache
        steps.append(np.asarray(one.logits[0, 0]))
    steps = np.stack(steps)  # [n, V]
    differing = {}
    for n in pass_sizes:
        whole = run(model.params, cache, jnp.asarray([extra[:n]]), (length + jnp.arange(n))[None], jnp.asarray([length]))
        differing[n] = int((np.asarray(whole.logits[0]) != steps[:n]).any(axis=-1).sum())
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4,8,16", help="query-row paddings W to measure")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", help="where to write the report")
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.bench import Variant, run_variants
    from specjax.decode.engine import Engine
    from specjax.decode.tree import TreeConfig
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter

    widths = [int(w) for w in args.rows.split(",")]
    base = at_compute_dtype(load_model("smollm2"), "bfloat16")
    drafter = at_compute_dtype(resolve_drafter("default", "smollm2"), "bfloat16")
    prompts = [base.tokenizer.encode_chat(p) for p in HELDOUT_CHAT_PROMPTS[: args.prompts]]
    padded = {w: dataclasses.replace(base, config=dataclasses.replace(base.config, query_rows=w)) for w in widths}

    extra = prompts[1][:16]  # real tokens, so the rows are what decoding would feed
    logits = {"unpadded": rows_differing(base, prompts[0], extra, (8, 16))}
    logits.update({f"W={w}": rows_differing(padded[w], prompts[0], extra, (8, 16)) for w in widths})
    print("rows whose logits differ from a pass of 8 / 16 tokens, one token at a time:")
    for label, counts in logits.items():
        print(f"  {label}: {counts}")

    variants = [Variant("ar", Engine(base, drafter), "ar")]
    for w in widths:
        engine = Engine(padded[w], drafter)
        variants.append(Variant(f"ar W={w}", engine, "ar"))
        variants.append(Variant(f"tree@{w} W={w}", engine, "tree", (("tree", TreeConfig(budget=w)),)))
        variants.append(Variant(f"chain W={w}", engine, "chain"))  # verifies min(block, W) rows
    report = run_variants(variants, prompts, args.max_new_tokens)
    print(f"\nbf16, {len(prompts)} prompts x {args.max_new_tokens} tokens, batch 1")
    print("| variant | tokens/s | against unpadded AR | tau | identical to AR at its W |")
    print("|---|---|---|---|---|")
    methods = report["methods"]
    for label, entry in methods.items():
        width = label.split("W=")[-1] if "W=" in label else None
        reference = methods[f"ar W={width}"]["outputs"] if width else methods["ar"]["outputs"]
        speed = entry.get("speedup_vs_ar", 1.0)
        print(f"| {label} | {entry['tokens_per_s']:.1f} | {speed:.2f}x | {entry['tau'] or 1.0:.2f} | "
              f"{entry['outputs'] == reference} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"logits": logits, "decode": report}, f, indent=1)


if __name__ == "__main__":
    main()
