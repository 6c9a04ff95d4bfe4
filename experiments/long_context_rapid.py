"""RAPID against AR and chain drafting at long context, on SmolLM2 (issue 17).

Tasks with exact answers are built from the corpora (`specjax/data/longbench.py`: KJV verse lookup,
speaker attribution in Shakespeare, a needle in Austen) at each context length. For every task the
same prompt (document + question, chat template) is decoded greedily by every method in one process;
rapid drafts from passages retrieved from the document for the question. Reported per context length:
decode tokens/s (the prefill timed apart: at long context it dominates a short answer) with the
prefill time, as medians over tasks, and the ratio to AR measured side by side, tau, whether every output
equals AR's, retrieval time, index build time, and each method's answer accuracy.

    python experiments/long_context_rapid.py --contexts 2048,4096,8192 --per-task 2 --json runs/rapid.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,4096,8192")
    parser.add_argument("--per-task", type=int, default=2, help="tasks of each kind per context length")
    parser.add_argument("--tasks", default="verse,speaker,needle")
    parser.add_argument("--methods", default="ar,chain,windowed,rapid,rapid+block",
                        help="ar, chain, windowed (chain with a windowed drafter, --window), rapid and rapid+block")
    parser.add_argument("--window", type=int, default=256, help="the windowed drafter's raw window")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rapid-drafts", type=int, default=4)
    parser.add_argument("--retriever", default="minilm", choices=["minilm", "bm25"])
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--retrieval-budget", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    from tqdm.auto import tqdm

    from specjax.data.longbench import build_tasks, is_correct
    from specjax.data.retrieval import IndexCache, RetrievalConfig, long_context_prompt
    from specjax.decode.engine import Engine
    from specjax.decode.rapid import RapidConfig
    from specjax.io.encoder import load_sentence_encoder
    from specjax.io.compressor import windowed_drafter
    from specjax.io.registry import load_model, resolve_compressor, resolve_drafter

    model = load_model("smollm2")
    drafter = resolve_drafter("default", "smollm2")
    # One prompt bucket per context length, so the tasks of a length share compiled programs.
    engine = Engine(model, drafter, prompt_bucket=512)
    engines = {"windowed": Engine(model, windowed_drafter(drafter, resolve_compressor("default", "smollm2"),
                                                          args.window), prompt_bucket=512)}
    encoder = load_sentence_encoder() if args.retriever == "minilm" else None
    config = RetrievalConfig(retriever=args.retriever, chunk_tokens=args.chunk_tokens,
                             budget_tokens=args.retrieval_budget)
    methods = args.methods.split(",")
    cache = IndexCache()
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        tasks = build_tasks(model.tokenizer, context, args.per_task, args.seed, args.tasks.split(","))
        for task in tqdm(tasks, desc=f"{context} tokens", file=sys.stderr):
            prompt = long_context_prompt(model.tokenizer, task.context, task.question, config, cache, encoder)
            row = {"context": context, "task": task.task, "source": task.source, "answer": task.answer,
                   "prompt_tokens": len(prompt.full), **prompt.summary(config)}
            for method in methods:
                options = {}
                if method == "rapid":
                    options = dict(retrieval_prompts=[prompt.drafting], rapid=RapidConfig(args.rapid_drafts))
                elif method == "rapid+block":
                    options = dict(retrieval_prompts=[prompt.drafting])
                runner = engines.get(method, engine)
                decode_method = "chain" if method == "windowed" else method
                runner.generate([prompt.full], args.max_new_tokens, method=decode_method, **options)  # compile, warm
                started = time.perf_counter()
                out = runner.generate([prompt.full], args.max_new_tokens, method=decode_method, **options)
                text = model.tokenizer.decode(out.tokens[0])
                row[method] = {"tokens_per_s": out.stats["decode_tokens_per_s"], "prefill_s": out.stats["prefill_s"],
                               "tau": out.stats.get("tau"),
                               "tokens": out.tokens[0], "correct": is_correct(task, text), "text": text,
                               "call_s": time.perf_counter() - started}
            for method in methods:
                row[method]["identical_to_ar"] = row[method]["tokens"] == row["ar"]["tokens"]
                row[method]["speedup_vs_ar"] = row[method]["tokens_per_s"] / row["ar"]["tokens_per_s"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in methods}
                             | {m: {k: row[m][k] for k in ("tokens_per_s", "tau", "correct", "identical_to_ar")}
                                for m in methods}), file=sys.stderr, flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(summary(rows, methods))
    return 0


def summary(rows: list[dict], methods: list[str]) -> str:
    lines = ["| context | method | decode tok/s | vs AR | prefill s | tau | identical to AR | accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for context in sorted({r["context"] for r in rows}):
        group = [r for r in rows if r["context"] == context]
        for m in methods:
            taus = [r[m]["tau"] for r in group if r[m]["tau"] is not None]
            tps = statistics.median(r[m]["tokens_per_s"] for r in group)
            ratio = statistics.median(r[m]["speedup_vs_ar"] for r in group)
            tau = f"{statistics.median(taus):.2f}" if taus else "-"
            same, right = sum(r[m]["identical_to_ar"] for r in group), sum(r[m]["correct"] for r in group)
            prefill = statistics.median(r[m]["prefill_s"] for r in group)
            lines.append(f"| {context} | {m} | {tps:.1f} | {ratio:.2f}x | {prefill:.1f} | {tau} | {same}/{len(group)} | "
                         f"{right}/{len(group)} |")
        retrieval = [r["retrieval_s"] for r in group if "retrieval_s" in r]
        builds = [r["index_build_s"] for r in group if r.get("index_build_s")]
        if retrieval:
            lines.append(f"| {context} | (retrieval) | median {statistics.median(retrieval) * 1e3:.0f} ms per query, "
                         f"index build {statistics.median(builds):.2f} s | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
