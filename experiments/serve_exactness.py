"""Greedy requests through the serving scheduler against `specjax generate` (issue 15, item 9):
SmolLM2 with its committed drafter, held-out prompts, every request sharing the slots with others.

    python experiments/serve_exactness.py [--prompts 12] [--max-new-tokens 64] [--slots 4] [--method chain]
        [--dtype float32|bfloat16] [--query-rows auto|N]

For each prompt it decodes (a) AR alone (Engine.generate, batch 1), (b) the method alone
(Engine.generate, batch 1) and (c) the method through the scheduler with all prompts submitted at
once, so every slot is busy and rows join and leave around each request. It prints how many
outputs are identical and, where one differs, the first differing token.
"""

from __future__ import annotations

import argparse


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--method", default="chain")
    parser.add_argument("--category", default="chat")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="chunked prefill size (0 = whole prompts)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute precision")
    parser.add_argument("--query-rows", default="auto", help="as `specjax generate --query-rows`")
    args = parser.parse_args()

    from specjax.data.prompts import heldout_prompts
    from specjax.decode.engine import Engine
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter, resolve_refiner, with_query_rows
    from specjax.serve.scheduler import Request, Scheduler, ServeConfig

    model = with_query_rows(load_model("smollm2", args.dtype), args.query_rows)
    drafter = resolve_drafter("default", "smollm2") if args.method != "ar" else None
    drafter = at_compute_dtype(drafter, args.dtype) if drafter is not None else None
    refiner = resolve_refiner("default", "smollm2") if args.method.endswith("+refiner") else None
    texts = heldout_prompts(args.category)[: args.prompts]
    prompts = [model.tokenizer.encode_chat(t) for t in texts]
    engine = Engine(model, drafter, refiner=refiner)
    ar = [engine.generate([p], args.max_new_tokens).tokens[0] for p in prompts]
    alone = [engine.generate([p], args.max_new_tokens, method=args.method).tokens[0] for p in prompts]
    scheduler = Scheduler(model, drafter, ServeConfig(method=args.method, slots=args.slots, context_length=512,
                                                      max_new_tokens=args.max_new_tokens,
                                                      prefill_chunk=args.prefill_chunk), refiner=refiner)
    handles = [scheduler.submit(Request(tuple(p), max_tokens=args.max_new_tokens, temperature=0.0)) for p in prompts]
    served = [h.result().token_ids for h in handles]
    scheduler.shutdown()

    print(f"\nSmolLM2, {len(prompts)} held-out {args.category} prompts, {args.max_new_tokens} new tokens, "
          f"greedy, {args.dtype} (query rows {model.config.query_rows or 'unpadded'}); {args.method} through {args.slots} slots, prefill chunk {args.prefill_chunk}\n")
    print("| prompt | served = generate (same method) | served = AR | generate = AR |")
    print("|---|---|---|---|")
    counts = [0, 0, 0]
    for i, (a, g, s) in enumerate(zip(ar, alone, served)):
        checks = [first_difference(s, g), first_difference(s, a), first_difference(g, a)]
        counts = [c + (d is None) for c, d in zip(counts, checks)]
        cells = ["yes" if d is None else f"no (token {d})" for d in checks]
        print(f"| {i + 1} | " + " | ".join(cells) + " |")
    n = len(prompts)
    print(f"\nidentical: served = generate {counts[0]}/{n}; served = AR {counts[1]}/{n}; generate = AR {counts[2]}/{n}")


if __name__ == "__main__":
    main()
