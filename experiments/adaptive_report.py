"""Summarise `experiments/adaptive_sweep.sh`: output tok/s and p50/p99 TPOT per method and request
rate (the mean over the sweep's repetitions, with their largest spread); at each rate the adaptive
server's throughput against the best fixed policy's and its p50 TPOT against that policy's (the best
is the highest throughput, ties below saturation going to the lowest p50 TPOT); for each fixed
policy, the rate where adaptive beats it by the most in throughput and in p50 TPOT; what the
controller did; and a plot of throughput and TPOT against rate for every method.

    python experiments/adaptive_report.py OUT_DIR METHODS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specjax.serve.top import parse_metrics


def _name(method: str) -> str:
    return method.replace(":", "_").replace("@", "_")


def load_sweep(folder: Path, method: str) -> tuple[list[dict], list[list[dict]]]:
    """One method's rows, one per rate in sweep order, each the mean over repetitions of the
    interleaved sweep (`NAME.repN.rateR.json`), and the repetitions' rows per rate; an older,
    one-pass sweep folder holds `NAME.sweep.json` instead."""
    files = sorted(folder.glob(f"{_name(method)}.rep*.rate*.json"))
    if not files:
        rows = json.loads((folder / f"{_name(method)}.sweep.json").read_text())["sweep"]
        return rows, [[row] for row in rows]
    by_rate: dict[int, list[dict]] = {}
    for file in files:
        rate_index = int(file.name.rsplit(".rate", 1)[1].removesuffix(".json"))
        result = json.loads(file.read_text())  # one rate: the run itself, not a one-row sweep
        by_rate.setdefault(rate_index, []).extend(result.get("sweep", [result]))
    reps = [by_rate[i] for i in sorted(by_rate)]
    mean = lambda rows, get: sum(get(r) for r in rows) / len(rows)  # noqa: E731
    merged = [{"request_rate": rows[0]["request_rate"],
               "output_token_throughput": mean(rows, lambda r: r["output_token_throughput"]),
               "tpot_ms": {q: mean(rows, lambda r: r["tpot_ms"][q]) for q in ("p50", "p99")},
               "failed": sum(r["failed"] for r in rows), "completed": sum(r["completed"] for r in rows)}
              for rows in reps]
    return merged, reps


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1 if min(values) > 0 else 0.0


def main(out: str, methods: str) -> None:
    folder = Path(out)
    methods = methods.split(",")
    loaded = {m: load_sweep(folder, m) for m in methods}
    sweeps = {m: loaded[m][0] for m in methods}
    rates = [row["request_rate"] for row in sweeps[methods[0]]]
    at = {(m, row["request_rate"]): row for m in methods for row in sweeps[m]}
    label = lambda r: "all at once" if r is None else f"{r:g} req/s"  # noqa: E731
    print("Output tok/s (TPOT p50 / p99 ms) at each request rate:\n")
    print("| method | " + " | ".join(label(r) for r in rates) + " |")
    print("|---|" + "---|" * len(rates))
    for m in methods:
        cells = []
        for r in rates:
            row = at[m, r]
            tpot = row["tpot_ms"]
            cells.append(f"{row['output_token_throughput']:.1f} ({tpot['p50']:.0f} / {tpot['p99']:.0f})")
        print(f"| {m} | " + " | ".join(cells) + " |")
    count = min(len(rows) for m in methods for rows in loaded[m][1])
    if count > 1:
        thr = max(spread([r["output_token_throughput"] for r in rows]) for m in methods for rows in loaded[m][1])
        tpot = max(spread([r["tpot_ms"]["p50"] for r in rows]) for m in methods for rows in loaded[m][1])
        print(f"\nEach figure is the mean of {count} interleaved repetitions; the largest spread between "
              f"repetitions of one method at one rate was {thr:.0%} in throughput and {tpot:.0%} in p50 TPOT.")
    fixed = [m for m in methods if m != "adaptive"]
    if "adaptive" in methods and fixed:
        print()
        for r in rates:
            best = best_fixed(fixed, at, r)
            ratio = at["adaptive", r]["output_token_throughput"] / at[best, r]["output_token_throughput"]
            tpot = at["adaptive", r]["tpot_ms"]["p50"] / at[best, r]["tpot_ms"]["p50"]
            print(f"- {label(r)}: adaptive / best fixed ({best}) = {ratio:.2f} in throughput, "
                  f"{tpot:.2f} in p50 TPOT; {at['adaptive', r]['failed']} adaptive requests failed")
        for m in fixed:
            gains = {r: at["adaptive", r]["output_token_throughput"] / at[m, r]["output_token_throughput"] for r in rates}
            faster = {r: at[m, r]["tpot_ms"]["p50"] / at["adaptive", r]["tpot_ms"]["p50"] for r in rates}
            r, q = max(gains, key=gains.get), max(faster, key=faster.get)
            print(f"- against {m}: adaptive's largest lead is {gains[r]:.2f}x in throughput at {label(r)}, "
                  f"{faster[q]:.2f}x in p50 TPOT (its TPOT over adaptive's) at {label(q)}")
        snap = parse_metrics((folder / "adaptive.metrics.txt").read_text())
        switches = {k.removeprefix("switches_"): int(v) for k, v in snap.counters.items() if k.startswith("switches_")}
        print(f"- adaptive, policy switches by reason over the sweep: {switches}")
        steps: dict[str, int] = {}
        for line in (folder / "adaptive.run.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("kind", "request") == "request":
                for policy, count in record.get("policy_steps", {}).items():
                    steps[policy] = steps.get(policy, 0) + count
        print(f"- adaptive, request steps by policy over the sweep: {steps}")
    plot(folder / "sweep.png", methods, rates, at)
    print(f"\nplot: {folder / 'sweep.png'}")


def best_fixed(fixed: list[str], at: dict, rate, tie: float = 0.05) -> str:
    """The fixed policy to hold adaptive against at one rate: the highest throughput; among those
    within `tie` of it (below saturation every server delivers the offered load, so throughput
    ties), the one with the lowest p50 TPOT, the stricter comparison for adaptive."""
    top = max(at[m, rate]["output_token_throughput"] for m in fixed)
    near = [m for m in fixed if at[m, rate]["output_token_throughput"] >= (1 - tie) * top]
    return min(near, key=lambda m: at[m, rate]["tpot_ms"]["p50"])


def plot(path: Path, methods: list[str], rates: list, at: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(rates)))  # evenly spaced: the rates span idle to overload
    fig, (thr, p50, p99) = plt.subplots(1, 3, figsize=(15, 4.5))
    for m in methods:
        style = dict(lw=2.5, color="black") if m == "adaptive" else dict(lw=1.2)
        thr.plot(xs, [at[m, r]["output_token_throughput"] for r in rates], "-o", label=m, **style)
        p50.plot(xs, [at[m, r]["tpot_ms"]["p50"] for r in rates], "-o", label=m, **style)
        p99.plot(xs, [at[m, r]["tpot_ms"]["p99"] for r in rates], "-o", label=m, **style)
    names = ["all" if r is None else f"{r:g}" for r in rates]
    for ax, title, unit in ((thr, "Output throughput", "tokens/s"), (p50, "TPOT p50", "ms"), (p99, "TPOT p99", "ms")):
        ax.set_xticks(xs, names)
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    thr.legend(fontsize=8)
    fig.suptitle("Adaptive against fixed policies across load (specjax, experiments/adaptive_sweep.sh)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(*sys.argv[1:3])
