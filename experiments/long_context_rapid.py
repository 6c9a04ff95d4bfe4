"""RAPID against AR and chain drafting at long context, on SmolLM2 (issue 17).

Tasks with exact answers are built from the corpora (`specjax/data/longbench.py`: KJV verse lookup,
speaker attribution in Shakespeare, a needle in Austen) at each context length. For every task the
same prompt (document + question, chat template) is decoded greedily by every method in one process;
rapid drafts from passages retrieved from the document for the question. Reported per context length:
decode tokens/s (the prefill timed apart: at long context it dominates a short answer) with the
prefill time, as medians over tasks, and the ratio to AR measured side by side, tau, whether every output
equals AR's, retrieval time, index build time, and each method's answer accuracy.

Each method's step is split into its draft and verify parts by the shares of the two passes timed
alone at the same shapes (the steps themselves are fused). A method named rapid@ETA runs rapid with knowledge transfer at that eta
(lossy): the accuracy table compares the target alone (ar) with it.

    python experiments/long_context_rapid.py --contexts 2048,4096,7936 --per-task 2 --json runs/rapid.json
    python experiments/long_context_rapid.py --contexts 2048 --per-task 4 --methods ar,rapid@5,rapid@20 \
        --json runs/rapid_eta.json

`--dtype` is the CLI's: auto is bf16 on a CPU with bf16 dot instructions, where every step (AR's too)
runs 8 padded query rows so that speculation stays exact against AR; `ar:unpadded` then times AR at one
row a step, the fastest AR of that precision.

SmolLM2's window is 8,192 tokens in all, so its "8k" documents hold 7,936 tokens, leaving room for the
question, the chat template and the answer.
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
                        help="ar, chain, windowed (chain with a windowed drafter, --window), rapid, rapid+block, "
                             "rapid@ETA (rapid with knowledge transfer at eta ETA, lossy), rapid+redraft or "
                             "rapid+block+redraft (re-retrieving every --redraft-every tokens), and ar:unpadded "
                             "(AR with one query row a step: the speed reference where steps are padded)")
    parser.add_argument("--redraft-every", type=int, default=16,
                        help="the +redraft methods retrieve again every this many generated tokens")
    parser.add_argument("--window", type=int, default=256, help="the windowed drafter's raw window")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rapid-drafts", type=int, default=4)
    parser.add_argument("--retriever", default="minilm", choices=["minilm", "bm25"])
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--retrieval-budget", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="compute precision of target and drafters, as `specjax generate --dtype` (auto: bf16 "
                             "on a CPU with bf16 dot instructions, its steps padded to 8 query rows)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    from tqdm.auto import tqdm

    from specjax.data.longbench import build_tasks, is_correct
    from specjax.data.retrieval import IndexCache, RetrievalConfig, long_context_prompt, redrafting
    from specjax.decode.engine import Engine
    from specjax.decode.rapid import RapidConfig
    from specjax.io.encoder import load_sentence_encoder
    from specjax.io.compressor import windowed_drafter
    from specjax.io.registry import (at_compute_dtype, compute_dtype, load_model, resolve_compressor,
                                     resolve_drafter, with_query_rows)

    dtype = args.resolved_dtype = compute_dtype(args.dtype)  # recorded in the JSON beside "auto"
    base_model = load_model("smollm2", dtype)
    model = with_query_rows(base_model, "auto")  # bf16: every step padded to 8 rows, so AR = verify
    drafter = resolve_drafter("default", "smollm2")
    windowed = windowed_drafter(drafter, resolve_compressor("default", "smollm2"), args.window)
    # One prompt bucket per context length, so the tasks of a length share compiled programs.
    engine = Engine(model, at_compute_dtype(drafter, dtype), prompt_bucket=512)
    engines = {"windowed": Engine(model, at_compute_dtype(windowed, dtype), prompt_bucket=512),
               "ar:unpadded": Engine(with_query_rows(base_model, 0), prompt_bucket=512)}
    print(f"compute dtype {dtype}, query rows {model.config.query_rows or 1}", file=sys.stderr)
    encoder = load_sentence_encoder() if args.retriever == "minilm" else None
    config = RetrievalConfig(retriever=args.retriever, chunk_tokens=args.chunk_tokens,
                             budget_tokens=args.retrieval_budget)
    methods = args.methods.split(",")
    cache = IndexCache()
    rows = []
    warm = set()  # (method, prompt bucket, drafting bucket): tasks of one shape share compiled programs
    for context in [int(c) for c in args.contexts.split(",")]:
        tasks = build_tasks(model.tokenizer, context, args.per_task, args.seed, args.tasks.split(","))
        for task in tqdm(tasks, desc=f"{context} tokens", file=sys.stderr):
            prompt = long_context_prompt(model.tokenizer, task.context, task.question, config, cache, encoder)
            row = {"context": context, "task": task.task, "source": task.source, "answer": task.answer,
                   "prompt_tokens": len(prompt.full), **prompt.summary(config)}
            for method in methods:
                options = {}
                base, _, eta = method.removesuffix("+redraft").partition("@")
                if base == "rapid":
                    options = dict(drafting_prompts=[prompt.drafting],
                                   rapid=RapidConfig(args.rapid_drafts, eta=float(eta or 0)))
                elif base == "rapid+block":
                    options = dict(drafting_prompts=[prompt.drafting])
                if method.endswith("+redraft"):
                    options["redraft"] = redrafting(model.tokenizer, task.context, task.question, config,
                                                    args.redraft_every, cache, encoder)
                runner = engines.get(method, engine)
                decode_method = {"windowed": "chain", "ar:unpadded": "ar"}.get(method, base)
                shape = (method, -(-len(prompt.full) // 512), -(-len(prompt.drafting) // 512))
                if shape not in warm:  # compile and warm once per shape
                    runner.generate([prompt.full], args.max_new_tokens, method=decode_method, **options)
                    warm.add(shape)
                started = time.perf_counter()
                out = runner.generate([prompt.full], args.max_new_tokens, method=decode_method, **options)
                text = model.tokenizer.decode(out.tokens[0])
                stats = out.stats
                steps = stats.get("verify_steps") or len(out.tokens[0]) - 1  # AR: one step per token after the first
                decode_s = (len(out.tokens[0]) - 1) / max(stats["decode_tokens_per_s"], 1e-9)
                step_ms = 1e3 * decode_s / max(steps, 1)
                # The steps are fused: split the measured step by the draft and verify passes' shares,
                # each pass timed alone (alone, each call also pays what a fused loop hoists out of it).
                draft_share = (stats["draft_s"] / (stats["draft_s"] + stats["verify_s"])
                               if "draft_s" in stats else None)
                row[method] = {"tokens_per_s": stats["decode_tokens_per_s"], "prefill_s": stats["prefill_s"],
                               "tau": stats.get("tau"), "steps": steps, "step_ms": step_ms,
                               "draft_ms": None if draft_share is None else step_ms * draft_share,
                               "verify_ms": None if draft_share is None else step_ms * (1 - draft_share),
                               "lossy": "lossy" in stats, "redrafts": stats.get("redrafts"),
                               "redraft_s": stats.get("redraft_s"),
                               "redraft_prefill_tokens": stats.get("redraft_prefill_tokens"),
                               "tokens": out.tokens[0], "correct": is_correct(task, text), "text": text,
                               "call_s": time.perf_counter() - started}
            for method in methods:
                row[method]["identical_to_ar"] = row[method]["tokens"] == row["ar"]["tokens"]
                row[method]["speedup_vs_ar"] = row[method]["tokens_per_s"] / row["ar"]["tokens_per_s"]
            rows.append(row)
            save(args, rows)  # after every task: a stopped run keeps what it measured
            print(json.dumps({k: v for k, v in row.items() if k not in methods}
                             | {m: {k: row[m][k] for k in ("tokens_per_s", "tau", "correct", "identical_to_ar")}
                                for m in methods}), file=sys.stderr, flush=True)
    save(args, rows)
    print(summary(rows, methods))
    print()
    print(accuracy_table(rows, methods))
    return 0


def save(args, rows: list[dict]) -> None:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def summary(rows: list[dict], methods: list[str]) -> str:
    lines = ["| context | method | decode tok/s | vs AR | prefill s | tau | step ms (draft + verify) | "
             "identical to AR | accuracy |",
             "|---|---|---|---|---|---|---|---|---|"]
    ms = lambda group, m, key: statistics.median(r[m][key] for r in group)  # noqa: E731
    for context in sorted({r["context"] for r in rows}):
        group = [r for r in rows if r["context"] == context]
        for m in methods:
            taus = [r[m]["tau"] for r in group if r[m]["tau"] is not None]
            tps = statistics.median(r[m]["tokens_per_s"] for r in group)
            ratio = statistics.median(r[m]["speedup_vs_ar"] for r in group)
            tau = f"{statistics.median(taus):.2f}" if taus else "-"
            same, right = sum(r[m]["identical_to_ar"] for r in group), sum(r[m]["correct"] for r in group)
            prefill = statistics.median(r[m]["prefill_s"] for r in group)
            step = f"{ms(group, m, 'step_ms'):.0f}"
            if group[0][m].get("draft_ms") is not None:
                step += f" ({ms(group, m, 'draft_ms'):.0f} + {ms(group, m, 'verify_ms'):.0f})"
            name = f"{m} (lossy)" if group[0][m].get("lossy") else m
            if group[0][m].get("redrafts") is not None:
                name += (f" ({statistics.median(r[m]['redrafts'] for r in group):g} re-retrievals, "
                         f"{statistics.median(r[m]['redraft_s'] for r in group) * 1e3:.0f} ms, "
                         f"{statistics.median(r[m]['redraft_prefill_tokens'] for r in group):g} tokens prefilled)")
            lines.append(f"| {context} | {name} | {tps:.1f} | {ratio:.2f}x | {prefill:.1f} | {tau} | {step} | "
                         f"{same}/{len(group)} | {right}/{len(group)} |")
        retrieval = [r["retrieval_s"] for r in group if "retrieval_s" in r]
        builds = [r["index_build_s"] for r in group if r.get("index_build_s")]
        if retrieval:
            lines.append(f"| {context} | (retrieval) | median {statistics.median(retrieval) * 1e3:.0f} ms per query, "
                         f"index build {statistics.median(builds):.2f} s | | | | | | |")
    return "\n".join(lines)


def accuracy_table(rows: list[dict], methods: list[str]) -> str:
    """Answers right per task kind and method, over every context length."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lines = ["| method | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for m in methods:
        cells = []
        for task in tasks:
            group = [r for r in rows if r["task"] == task]
            cells.append(f"{sum(r[m]['correct'] for r in group)}/{len(group)}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
