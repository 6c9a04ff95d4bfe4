"""Compare drafter runs of `specjax train-drafter` side by side (made for the anchor-path ablation,
experiments/anchor_path_ablation.sh): per run, the slot-1 anchor spread, the logged learning curve
(train slot-1 accuracy, held-out teacher-forced tau), and real greedy chain decoding on the built-in
held-out chat prompts (tau, acceptance at draft slots 1-4), all in one process.

    python experiments/anchor_path_report.py RUN [RUN ...] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def curve(run: Path) -> list[tuple[int, float | None, float | None]]:
    """(step, mean train slot-1 accuracy since the previous eval, held-out tau estimate) per eval."""
    from specjax.train.loop import read_metrics

    rows, recent = [], []
    for m in read_metrics(run / "run"):
        if "slot1_accuracy" in m:
            recent.append(m["slot1_accuracy"])
        if "eval/tau_estimate" in m:
            rows.append((m["step"], float(np.mean(recent)) if recent else None, m["eval/tau_estimate"]))
            recent = []
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.engine import Engine
    from specjax.io.dflash import load_drafter
    from specjax.io.registry import load_model
    from specjax.train.drafter import anchor_spread

    model = load_model("smollm2")
    prompts = [model.tokenizer.encode_chat(p) for p in HELDOUT_CHAT_PROMPTS]
    table = []
    for run in args.runs:
        drafter = load_drafter(run / "drafter")
        print(f"\n== {run} (anchor path: {drafter.config.anchor_path})")
        print("step | train slot-1 accuracy | held-out tau estimate")
        for step, accuracy, tau in curve(run):
            print(f"{step:>5} | {'-' if accuracy is None else f'{accuracy:.3f}':>21} | {tau:.3f}")
        engine = Engine(model, drafter)
        ar = engine.generate(prompts, args.max_new_tokens)
        chain = engine.generate(prompts, args.max_new_tokens, method="chain")
        accept = chain.stats["per_position_acceptance"][:4]
        table.append((run.name, drafter.config.anchor_path, anchor_spread(model, drafter), chain.stats["tau"], accept,
                      chain.tokens == ar.tokens))
    print(f"\nheld-out chat: {len(prompts)} prompts, greedy, batch {len(prompts)}, {args.max_new_tokens} new tokens")
    print("| run | anchor path | slot-1 anchor spread (logits) | chain tau | acceptance at draft slots 1 / 2 / 3 / 4 "
          "| identical to ar |")
    print("|---|---|---|---|---|---|")
    for name, path, spread, tau, accept, same in table:
        print(f"| {name} | {path} | {spread:.3g} | {tau:.3f} | {' / '.join(f'{a:.3f}' for a in accept)} | {same} |")


if __name__ == "__main__":
    main()
