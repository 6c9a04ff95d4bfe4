"""Serving under KV memory pressure (issue 16, item 8): long prompts whose KV exceeds the budget.

SmolLM2 with its committed drafter (full attention), served by `Scheduler`s in this process:
`--slots` slots of `--context-length` tokens. The requests are passages of about `--context`
tokens from the corpora (the documents of `specjax/data/longbench.py`'s tasks: KJV chapters, plays,
Austen), each asking for a detailed retelling, greedy, up to `--max-tokens` new tokens, arriving at
`--rate` per second (Poisson, seeded). The KV budget (`--kv-budget-mib`, default:
`--budget-requests` whole requests' target KV at their longest) is far below what the slots can
hold, and the answers grow after admission, so the server must choose what to keep.

Configurations, each its own scheduler, all given the same requests at the same arrival times,
taking turns for `--reps` rounds (the order rotated each round, so this host's drift falls on each
alike):
- `adaptive`: the controller under the budget: admission paused on a projected overrun, then past
  the high water mark drafters windowed (`--relief-window`), drafter states dropped, and the newest
  requests preempted (recomputed later);
- `adaptive, no window`: the same without windowing, to see what it adds;
- `adaptive, recompute`: preempted requests recomputed from their tokens so far instead of parked on
  the host (`--preemption`), to see what parking keeps;
- `tree, budget`: the fixed tree under the same budget and memory manager;
- `tree, no budget`: the fixed tree with no memory control, what a fixed policy does: it holds
  whatever its slots fill, and the most it held is set against the budget (past it, a device with
  only the budget is out of memory);
- `ar, no budget`: AR, the speed reference.

Every output is checked against greedy AR at the same precision, each prompt decoded alone
(`Engine.generate`). Reported per configuration (means over rounds): requests finished, failed or
refused, output tok/s over the round, TTFT and TPOT p50/p99, the most KV bytes held against the
budget, preemptions, windows and drops, tau, and outputs equal to AR's.

    python experiments/memory_pressure.py --json runs/memory_pressure.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

CONFIGS = ("adaptive", "adaptive, no window", "adaptive, recompute", "tree, budget", "tree, no budget",
           "ar, no budget")


RETELL = "Retell the passage above in detail, in your own words."
"""The instruction every request ends with: answers that run long, so KV grows after admission."""


def build_requests(model, context: int, per_task: int, seed: int) -> list[list[int]]:
    from specjax.data.longbench import build_tasks
    from specjax.data.retrieval import long_context_prompt

    tasks = build_tasks(model.tokenizer, context, per_task, seed)
    return [long_context_prompt(model.tokenizer, t.context, RETELL).full for t in tasks]


def scheduler_for(name: str, model, drafter, args, budget_bytes: int):
    from specjax.serve.controller import ControllerConfig
    from specjax.serve.scheduler import Scheduler, ServeConfig

    method = name.split(",")[0]
    budget = None if "no budget" in name else budget_bytes
    window = None if "no window" in name else args.relief_window
    controller = ControllerConfig(kv_budget_bytes=budget, relief_window=window)
    config = ServeConfig(method=method, slots=args.slots, context_length=args.context_length,
                         max_new_tokens=args.max_tokens, controller=controller, max_queue=args.max_queue,
                         preemption="recompute" if "recompute" in name else args.preemption)
    scheduler = Scheduler(model, None if method == "ar" else drafter, config)
    scheduler.wait_compiled()
    return scheduler


def run_round(scheduler, prompts: list[list[int]], arrivals: np.ndarray, max_tokens: int, timeout: float) -> dict:
    """Submit every prompt at its arrival time; return what each request got and the KV peak."""
    from specjax.serve.scheduler import QueueFull, Request

    registry = scheduler.metrics.registry
    counter = lambda name: registry.get_sample_value(f"specjax:{name}_total") or 0.0  # noqa: E731
    before = {n: counter(n) for n in ("preemptions", "drafter_states_windowed", "drafter_states_dropped")}
    peak, stop = [0], threading.Event()

    def watch():  # the bytes the scheduler counts after every sync, sampled
        while not stop.is_set():
            state = scheduler.memory_state
            if state is not None:
                peak[0] = max(peak[0], state.bytes_in_use)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    handles, refused = [], 0
    start = time.perf_counter()
    for prompt, at in zip(prompts, arrivals):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        try:
            handles.append(scheduler.submit(Request(tuple(prompt), max_tokens=max_tokens, temperature=0.0, seed=0)))
        except QueueFull:
            refused += 1
            handles.append(None)
    results = [None if h is None else h.result(timeout=timeout) for h in handles]
    wall = time.perf_counter() - start
    stop.set()
    watcher.join()
    return {"results": results, "refused": refused, "wall_s": wall, "kv_peak_bytes": peak[0],
            **{n: counter(n) - before[n] for n in before}}


def summarise(round_: dict, reference: list[list[int]]) -> dict:
    results = round_["results"]
    done = [r for r in results if r is not None and r.finish_reason in ("stop", "length")]
    tokens = sum(len(r.token_ids) for r in done)
    ttft = [r.metrics["ttft_s"] for r in done if r.metrics.get("ttft_s") is not None]
    tpot = [(r.metrics["e2e_s"] - r.metrics["ttft_s"]) / (len(r.token_ids) - 1)
            for r in done if r.metrics.get("ttft_s") is not None and len(r.token_ids) > 1]
    steps = sum(r.metrics.get("speculative_decoding", {}).get("verify_steps", 0) for r in done)
    committed = sum(r.metrics.get("speculative_decoding", {}).get("mean_acceptance_length", 0.0)
                    * r.metrics.get("speculative_decoding", {}).get("verify_steps", 0) for r in done)
    pct = lambda v, q: float(np.percentile(v, q)) if v else None  # noqa: E731
    return {
        "finished": len(done), "failed": sum(r is not None and r not in done for r in results),
        "refused": round_["refused"], "wall_s": round_["wall_s"], "output_tokens_per_s": tokens / round_["wall_s"],
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99), "kv_peak_bytes": round_["kv_peak_bytes"],
        "preemptions": round_["preemptions"], "windows": round_["drafter_states_windowed"],
        "drops": round_["drafter_states_dropped"], "tau": committed / steps if steps else None,
        "identical_to_ar": sum(r is not None and r.token_ids == want for r, want in zip(results, reference)),
        # Per request: what memory pressure did to it, and where its output first differs from AR's.
        "requests": [None if r is None else {
            "tokens": len(r.token_ids), "preemptions": r.metrics.get("preemptions", 0),
            "windowed": r.metrics.get("drafter_windowed"), "dropped": r.metrics.get("drafter_state_dropped"),
            "first_difference": next((i for i, (a, b) in enumerate(zip(r.token_ids, want)) if a != b),
                                     None if r.token_ids == want else min(len(r.token_ids), len(want)))}
            for r, want in zip(results, reference)],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=512, help="document tokens per request")
    parser.add_argument("--per-task", type=int, default=4, help="requests of each task kind (3 kinds)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--kv-budget-mib", type=float, default=None)
    parser.add_argument("--budget-requests", type=float, default=2.5,
                        help="without --kv-budget-mib: the budget holds this many requests' target KV")
    parser.add_argument("--relief-window", type=int, default=256)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--preemption", default="park", choices=["park", "recompute"])
    parser.add_argument("--configs", default=",".join(c.replace(", ", ":") for c in CONFIGS),
                        help="which configurations, comma-separated, ', ' written ':'")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a request may take")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)

    from tqdm import tqdm

    from specjax.decode.engine import Engine
    from specjax.decode.memory import target_kv_bytes
    from specjax.decode.parts import resolve_parts
    from specjax.io.registry import load_model, with_query_rows

    configs = [c.replace(":", ", ") for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    model = with_query_rows(load_model("smollm2", args.dtype), "auto")
    drafter = resolve_parts(["chain", "tree"], model, "smollm2").drafter
    prompts = build_requests(model, args.context, args.per_task, args.seed)
    lengths = [len(p) for p in prompts]
    if max(lengths) + args.max_tokens + 8 > args.context_length:
        parser.error(f"prompts of up to {max(lengths)} tokens + {args.max_tokens} new do not fit "
                     f"--context-length {args.context_length}")
    per_token = target_kv_bytes(model.config, 1, 1)
    budget = int(args.kv_budget_mib * 2**20) if args.kv_budget_mib else int(
        args.budget_requests * (np.mean(lengths) + args.max_tokens) * per_token)
    arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1.0 / args.rate, len(prompts)))
    arrivals -= arrivals[0]
    print(f"{len(prompts)} requests of {min(lengths)}-{max(lengths)} prompt tokens + {args.max_tokens} new, "
          f"{args.rate:g}/s; target KV {per_token} bytes a token; budget {budget / 2**20:.1f} MiB "
          f"(the slots hold {args.slots * args.context_length * per_token / 2**20:.1f} MiB); {model.config.dtype}, "
          f"query rows {model.config.query_rows}", flush=True)

    engine = Engine(model)
    reference = [engine.generate([p], args.max_tokens).tokens[0]
                 for p in tqdm(prompts, desc="AR reference, one prompt at a time")]

    schedulers = {}
    for name in tqdm(configs, desc="compiling servers"):
        schedulers[name] = scheduler_for(name, model, drafter, args, budget)
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for rep in range(args.reps):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for name in order:
                summary = summarise(run_round(schedulers[name], prompts, arrivals, args.max_tokens, args.timeout),
                                    reference)
                rounds[name].append(summary)
                print(f"round {rep + 1} {name}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                                               for k, v in summary.items()}), flush=True)
    finally:
        for scheduler in schedulers.values():
            scheduler.shutdown(drain=False)

    def mean(name, key):
        values = [r[key] for r in rounds[name] if r[key] is not None]
        return float(np.mean(values)) if values else None

    keys = [k for k in rounds[configs[0]][0] if k != "requests"]
    table = {name: {k: mean(name, k) for k in keys} for name in configs}
    ms = lambda s: "-" if s is None else f"{1000 * s:.0f}"  # noqa: E731
    lines = [f"Budget {budget / 2**20:.1f} MiB; {len(prompts)} requests; means over {args.reps} rounds.", "",
             "| configuration | finished / failed / refused | tok/s | TTFT p50 / p99 s | TPOT p50 / p99 ms "
             "| KV peak (x budget) | preempted | windowed | dropped | tau | identical to AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        lines.append(
            f"| {name} | {row['finished']:.0f} / {row['failed']:.0f} / {row['refused']:.0f} "
            f"| {row['output_tokens_per_s']:.1f} | {row['ttft_p50_s']:.1f} / {row['ttft_p99_s']:.1f} "
            f"| {ms(row['tpot_p50_s'])} / {ms(row['tpot_p99_s'])} "
            f"| {row['kv_peak_bytes'] / 2**20:.1f} MiB ({row['kv_peak_bytes'] / budget:.2f}x) "
            f"| {row['preemptions']:.1f} | {row['windows']:.1f} | {row['drops']:.1f} | {tau} "
            f"| {row['identical_to_ar']:.0f} of {len(prompts)} |")
    print("\n".join(lines))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "budget_bytes": budget, "prompt_tokens": lengths,
                                           "rounds": rounds, "means": table, "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
