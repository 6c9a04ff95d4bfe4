"""Held-out tau estimate against training step for one or more drafter runs, from their metrics logs.

    python experiments/plot_learning_curves.py --run "sg1 (1 layer)=runs/sg1/run" \
        --run "sg2 (3 layers)=runs/sg2/run" --out docs/drafter_sharegpt_depth3_curve.png

Each run folder holds the metrics.jsonl that `specjax train-drafter` writes (eval/tau_estimate at
every evaluation); the plot also shows the training loss, smoothed over 50 steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(folder: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, tau estimate) at each evaluation and (step, loss) at each logged step, the last
    record of a step winning (a resumed run logs some steps twice)."""
    taus, losses = {}, {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/tau_estimate" in record:
            taus[record["step"]] = record["eval/tau_estimate"]
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return sorted(taus.items()), sorted(losses.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="label=folder (repeat for each run)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--title", default="Held-out ShareGPT tau estimate during training")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (tau_axis, loss_axis) = plt.subplots(1, 2, figsize=(12, 4))
    for spec in args.run:
        label, _, folder = spec.partition("=")
        taus, losses = read(Path(folder))
        if taus:
            steps, values = zip(*taus)
            tau_axis.plot(steps, values, marker="o", label=label)
            tau_axis.annotate(f"{values[-1]:.3f}", (steps[-1], values[-1]), textcoords="offset points", xytext=(4, 4))
        if losses:
            steps, values = map(np.asarray, zip(*losses))
            window = min(50, len(values))
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            loss_axis.plot(steps[window - 1:], smooth, label=label)
    tau_axis.set(xlabel="training step", ylabel="tau estimate (tokens per verify step)", title=args.title)
    loss_axis.set(xlabel="training step", ylabel="training loss (50-step mean)", title="Training loss")
    tau_axis.legend()
    loss_axis.legend()
    plt.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
