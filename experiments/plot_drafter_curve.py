"""Learning curve of a drafter run: held-out tau estimate and train loss against training tokens.

    python experiments/plot_drafter_curve.py runs/drafter-smollm2 [--out docs/drafter_learning_curve.png]

Training tokens are sequences seen x sequence length (the recipe in run_dir/recipe.json says how
many of each per step). The tau estimate is teacher-forced on the held-out chat continuations:
1 + the accepted prefix of each block's argmax drafts, averaged over random anchors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default="docs/drafter_learning_curve.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specjax.train.loop import read_metrics

    run = Path(args.run_dir)
    recipe = json.loads((run / "recipe.json").read_text())
    tokens_per_step = recipe["sequences_per_batch"] * recipe["seq_len"]
    metrics = read_metrics(run / "run")
    train = [(m["step"] * tokens_per_step, m["loss"]) for m in metrics if "loss" in m]
    evals = [(m["step"] * tokens_per_step, m["eval/tau_estimate"]) for m in metrics if "eval/tau_estimate" in m]

    slot1 = [(m["step"] * tokens_per_step, m["slot1_accuracy"]) for m in metrics if "slot1_accuracy" in m]
    window = max(1, len(slot1) // 20)  # each logged batch is 4 sequences: smooth over about 5% of the run
    smoothed = [(slot1[i][0], sum(a for _, a in slot1[max(0, i - window + 1) : i + 1]) / len(slot1[max(0, i - window + 1) : i + 1]))
                for i in range(len(slot1))]

    fig, (ax_tau, ax_slot1, ax_loss) = plt.subplots(1, 3, figsize=(15, 4))
    ax_tau.plot(*zip(*evals), marker="o")
    ax_tau.set_xlabel("training tokens seen")
    ax_tau.set_ylabel("held-out tau estimate (teacher-forced)")
    ax_tau.set_title("acceptance length")
    ax_tau.grid(alpha=0.3)
    if smoothed:
        ax_slot1.plot(*zip(*smoothed))
    ax_slot1.set_xlabel("training tokens seen")
    ax_slot1.set_ylabel(f"train slot-1 accuracy (mean of the last {window} logs)")
    ax_slot1.set_title("first draft slot, training batches")
    ax_slot1.grid(alpha=0.3)
    ax_loss.plot(*zip(*train), linewidth=0.8)
    ax_loss.set_xlabel("training tokens seen")
    ax_loss.set_ylabel("train loss (decay-weighted CE)")
    ax_loss.set_title("loss")
    ax_loss.grid(alpha=0.3)
    fig.suptitle(f"drafter for SmolLM2: {recipe['num_layers']} layer, block {recipe['block_size']}")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(json.dumps({"plot": args.out, "evals": evals, "slot1_accuracy_smoothed_last": smoothed[-1] if smoothed else None}))


if __name__ == "__main__":
    main()
