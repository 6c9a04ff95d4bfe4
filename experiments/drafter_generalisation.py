"""Does a drafter fall short on held-out prompts because it memorised its training answers, or
because held-out prompts are a different kind? (issue 14, item 6)

    python experiments/drafter_generalisation.py --drafter v4=default \
        --set seen-chat=runs/lever/data/chat --set unseen-chat=runs/data-s1/data/chat \
        --set heldout-chat=runs/lever/data/heldout_chat [--sequences 40] [--json out.json]

Each drafter is scored on each distillation set by greedy chain decoding replayed over the set's
answers (`train/drafter.py:chain_walk_tau`, the estimate that matched real decoding within 0.05 on
held-out chat), on the same `--sequences` answers per set (drawn with a fixed seed, looping answers
left out). A drafter that scores far higher on answers it trained on than on unseen answers of the
same kind has memorised them, and more data of that kind is its lever; one that scores alike on
both, but lower on held-out prompts, needs data closer to the held-out kind.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=_pair, action="append", required=True,
                        help="NAME=FOLDER (a DFlash-format drafter, or default); repeatable")
    parser.add_argument("--set", type=_pair, action="append", required=True,
                        help="NAME=FOLDER of a distillation set (train-drafter's data/<kind>); repeatable")
    parser.add_argument("--sequences", type=int, default=40, help="answers scored per set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the table here as JSON too")
    args = parser.parse_args()
    if args.sequences < 1:
        parser.error("--sequences must be at least 1")

    import numpy as np

    from specjax.io.registry import load_model, resolve_drafter
    from specjax.train.drafter import DistillationSet, heldout_chain_tau, without_looping

    model = load_model("smollm2", "bfloat16")
    sets = {}
    for name, folder in args.set:
        whole, _ = without_looping(DistillationSet.open(folder))
        rng = np.random.default_rng(args.seed)
        keep = np.sort(rng.choice(whole.num_sequences, min(args.sequences, whole.num_sequences), replace=False))
        sets[name] = whole.rows(keep)
        print(f"{name}: {len(keep)} of {whole.num_sequences} non-looping answers ({folder})", flush=True)
    table = {}
    for name, folder in args.drafter:
        drafter = resolve_drafter(folder, "smollm2")
        table[name] = {}
        for set_name, data in sets.items():
            tau = heldout_chain_tau(data, drafter.config, model.params, model.config, drafter.draft_vocab)(drafter.params)
            table[name][set_name] = tau
            print(f"{name} on {set_name}: chain-walk tau {tau:.3f}", flush=True)
    print("\n| drafter | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(f"{row[s]:.3f}" for s in sets) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"sequences": args.sequences, "sets": dict(args.set),
                                               "drafters": dict(args.drafter), "chain_walk_tau": table}, indent=1))


if __name__ == "__main__":
    main()
