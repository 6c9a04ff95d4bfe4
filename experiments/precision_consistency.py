"""Is a verify pass the same computation as the decode steps it replaces? float32 against bf16.

    python experiments/precision_consistency.py [--new-tokens 8] [--prompts 12] [--max-new-tokens 64]

Greedy speculative output equals greedy AR only where the target gives the same logits for a token
whether it arrives alone (a decode step) or among T new tokens (a verify pass). Two measurements on
SmolLM2, per compute dtype:

1. Logits: a chat prompt is prefilled, then `--new-tokens` tokens go through the model once as T
   single steps and once as one pass of T. Reported per dtype: the largest |difference| in the
   logits, how many rows differ at all, and the first decoder layer whose output differs.
1b. The same with every single step padded to T query rows, so that a step and a pass share all
   shapes (the question: would a fixed row count make bf16 verification bitwise exact?).
2. Greedy outputs on held-out chat prompts: bf16 AR against float32 AR (the information the issue
   asks for: how often the precisions diverge, and at which token), bf16 chain against bf16 AR, and
   with every forward padded to `--query-rows` rows (TransformerConfig.query_rows, what
   `--dtype bfloat16` does by default) chain, chain+refiner and tree against AR at that setting.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def step_against_pass(model, prompt: list[int], extra: list[int]) -> dict:
    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    cfg, params = model.config, model.params
    layers = tuple(range(cfg.num_layers))
    run = jax.jit(lambda c, t, pos, at: forward(params, cfg, t, pos, c, at, hidden_layers=layers))
    length = len(prompt)
    cache = run(KVCache.zeros(cfg, 1, 256), jnp.asarray([prompt]), jnp.arange(length)[None], jnp.asarray([0])).cache
    whole = run(cache, jnp.asarray([extra]), (length + jnp.arange(len(extra)))[None], jnp.asarray([length]))
    rows_differ, largest, first_layer = 0, 0.0, None
    for i, token in enumerate(extra):
        one = run(cache, jnp.asarray([[token]]), jnp.asarray([[length + i]]), jnp.asarray([length + i]))
        cache = one.cache
        difference = np.abs(np.asarray(one.logits[0, 0]) - np.asarray(whole.logits[0, i]))
        largest = max(largest, float(difference.max()))
        if difference.max() > 0:
            rows_differ += 1
            hidden_one, hidden_whole = np.asarray(one.hidden[0, 0]), np.asarray(whole.hidden[0, i])
            layer = next(l for l in layers if not np.array_equal(hidden_one[l], hidden_whole[l]))
            first_layer = layer if first_layer is None else min(first_layer, layer)
    return {"max_logit_difference": largest, "rows_that_differ": rows_differ, "rows": len(extra),
            "first_differing_layer": first_layer}


def padded_step_against_pass(model, prompt: list[int], extra: list[int]) -> dict:
    """Like step_against_pass, but each single step runs with T query rows: the token at row 0 and
    T-1 padding copies after it (causal, so they cannot reach row 0). Then a step and a verify pass
    have the same shapes everywhere; does the token's row come out bitwise the same?"""
    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    cfg, params = model.config, model.params
    run = jax.jit(lambda c, t, pos, at: forward(params, cfg, t, pos, c, at))
    length, width = len(prompt), len(extra)
    cache = run(KVCache.zeros(cfg, 1, 256), jnp.asarray([prompt]), jnp.arange(length)[None], jnp.asarray([0])).cache
    whole = run(cache, jnp.asarray([extra]), (length + jnp.arange(width))[None], jnp.asarray([length]))
    rows_differ, largest = 0, 0.0
    for i, token in enumerate(extra):
        padded = jnp.full((1, width), token, jnp.int32)
        one = run(cache, padded, (length + i + jnp.arange(width))[None], jnp.asarray([length + i]))
        cache = one.cache  # slot length+i is right; the padding's slots are overwritten next step
        difference = np.abs(np.asarray(one.logits[0, 0]) - np.asarray(whole.logits[0, i]))
        largest = max(largest, float(difference.max()))
        rows_differ += int(difference.max() > 0)
    return {"max_logit_difference": largest, "rows_that_differ": rows_differ, "rows": width}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps-only", action="store_true", help="stop after the logit measurements")
    parser.add_argument("--query-rows", type=int, default=16, help="the padded configuration's query rows")
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.engine import Engine
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter, resolve_refiner, with_query_rows

    base = load_model("smollm2")
    drafter = resolve_drafter("default", "smollm2")
    probe = base.tokenizer.encode_chat("Give me three tips for learning to cook.")
    extra = base.tokenizer.encode(" 1. Start with simple recipes and learn the basics")[: args.new_tokens]
    print("| dtype | largest logit difference, steps vs one pass | rows that differ | first layer that differs |")
    print("|---|---|---|---|")
    engines = {}
    for dtype in ("float32", "bfloat16"):
        model = at_compute_dtype(base, dtype)
        r = step_against_pass(model, probe, extra)
        print(f"| {dtype} | {r['max_logit_difference']:.2e} | {r['rows_that_differ']} of {r['rows']} | "
              f"{r['first_differing_layer']} |", flush=True)
        engines[dtype] = Engine(model, at_compute_dtype(drafter, dtype))
    print(f"\nEach step padded to {len(extra)} rows (the token at row 0), against one pass:")
    print("| dtype | largest logit difference | rows that differ |")
    print("|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        r = padded_step_against_pass(at_compute_dtype(base, dtype), probe, extra)
        print(f"| {dtype} | {r['max_logit_difference']:.2e} | {r['rows_that_differ']} of {r['rows']} |", flush=True)
    if args.steps_only:
        return

    prompts = [base.tokenizer.encode_chat(p) for p in HELDOUT_CHAT_PROMPTS[: args.prompts]]
    padded = with_query_rows(at_compute_dtype(base, "bfloat16"), args.query_rows)
    refiner = resolve_refiner("default", "smollm2")
    engines[f"bfloat16, {args.query_rows} rows"] = Engine(padded, at_compute_dtype(drafter, "bfloat16"), refiner=refiner)
    runs = [("float32", "ar"), ("bfloat16", "ar"), ("bfloat16", "chain")]
    runs += [(f"bfloat16, {args.query_rows} rows", m) for m in ("ar", "chain", "chain+refiner", "tree")]
    outputs = {}
    for target, method in runs:
        outputs[target, method] = [engines[target].generate([p], args.max_new_tokens, method=method).tokens[0]
                                   for p in prompts]
    comparisons = {"bf16 AR vs float32 AR": (runs[1], runs[0]), "bf16 chain vs bf16 AR": (runs[2], runs[1])}
    comparisons.update({f"{a[1]} vs AR ({a[0]})": (a, runs[3]) for a in runs[4:]})
    for label, (a, b) in comparisons.items():
        firsts = [first_difference(x, y) for x, y in zip(outputs[a], outputs[b])]
        diverged = [f for f in firsts if f is not None]
        print(f"{label}: {len(diverged)} of {len(prompts)} prompts diverge within {args.max_new_tokens} tokens; "
              f"first differing token index per diverging prompt: {diverged}", flush=True)

if __name__ == "__main__":
    main()
