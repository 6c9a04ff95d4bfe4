"""How many self-distilled tokens a data folder adds to the earlier data sets, counting only answers
to prompts none of them asked.

    python experiments/fresh_tokens.py runs/refiner-s3/data

`--avoid-prompts-from` needs the earlier runs' folders. Where those are gone (a fresh host), their
prompts can still be rebuilt: every templated and corpus-passage prompt list is a pure function of
its kind, count and seed. The defaults are the recipes of the three data sets that issue 14's
self-distilled total counts (README, "The committed drafter"): `runs/lever` (seed 0), `runs/data-s1`
(seed 1) and `runs/data-s2` (seed 2). Self-instruct requests are written by the target and cannot be
rebuilt without it; the folder counted here should hold no self-instruct set.

Greedy answers to the same prompt repeat, so a prompt an earlier set asked, or one asked twice in
this folder, adds nothing: only the first answer to a new prompt counts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# kind:count:seed of the lever, data-s1 and data-s2 recipes (README), whose 2,974,454 tokens are the
# issue-14 total; the lists are supersets of what was answered (later seeds left out earlier prompts).
EARLIER = ("chat:2500:0", "everyday:1000:0", "math:800:0", "code:100:0",
           "chat:3000:1", "everyday:3192:1", "math:1500:1",
           "chat:15000:2", "math:6400:2")


def earlier_prompts(specs, corpora) -> set[str]:
    from specjax.data.corpora import load_split
    from specjax.data.prompts import code_task_prompts, everyday_chat_prompts, math_word_prompts, training_chat_prompts

    docs = None
    prompts: set[str] = set()
    for spec in specs:
        kind, count, seed = spec.split(":")
        count, seed = int(count), int(seed)
        if kind == "chat":
            docs = docs if docs is not None else load_split(corpora)[0]
            prompts.update(training_chat_prompts(docs, count, seed))
        elif kind == "everyday":
            prompts.update(everyday_chat_prompts(count, seed))
        elif kind == "math":
            prompts.update(math_word_prompts(count, seed))
        elif kind == "code":
            prompts.update(code_task_prompts(count, seed))
        else:
            raise SystemExit(f"unknown prompt kind {kind!r} in {spec!r}: chat, everyday, math or code")
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", help="data folders of train-drafter or train-refiner runs")
    parser.add_argument("--earlier", action="append", metavar="KIND:COUNT:SEED",
                        help="an earlier prompt list (repeatable); default: the issue-14 data sets' recipes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from specjax.io.registry import load_model
    from specjax.train.recipe import DistillRecipe
    from specjax.train.selfdistill import read_continuations

    files = sorted(f for folder in args.data for f in Path(folder).glob("*.continuations.jsonl")
                   if not f.name.startswith("heldout"))
    if not files:
        raise SystemExit(f"no training *.continuations.jsonl in {', '.join(args.data)}")
    tokenizer = load_model("smollm2").tokenizer
    asked = {tuple(tokenizer.encode_chat(p)) for p in earlier_prompts(args.earlier or EARLIER,
                                                                       DistillRecipe().corpora)}
    rows = []
    for path in files:
        found = read_continuations(path)
        fresh_prompts = fresh_tokens = 0
        for prompt, answer in found.values():
            if tuple(prompt) in asked:
                continue
            asked.add(tuple(prompt))  # a repeat later in this folder adds nothing either
            fresh_prompts += 1
            fresh_tokens += len(answer)
        rows.append({"file": str(path), "prompts": len(found), "tokens": sum(len(a) for _, a in found.values()),
                     "fresh_prompts": fresh_prompts, "fresh_tokens": fresh_tokens})
    total = {k: sum(r[k] for r in rows) for k in ("prompts", "tokens", "fresh_prompts", "fresh_tokens")}
    if args.json:
        print(json.dumps({"files": rows, "total": total}))
        return
    for r in rows + [{"file": "total", **total}]:
        print(f"{r['file']:<60} {r['prompts']:>6} prompts {r['tokens']:>9,} tokens; new: {r['fresh_prompts']:>6} "
              f"prompts {r['fresh_tokens']:>9,} tokens")


if __name__ == "__main__":
    main()
