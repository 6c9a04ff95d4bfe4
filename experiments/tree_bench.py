"""Draft trees against the chain on SmolLM2, at batch sizes 1, 4 and 8, all variants in one run.

At every batch size the variants decode the same held-out chat prompts, taking turns call by call
(specjax.decode.bench.run_variants), with `ar` and `chain` as baselines. For each tree variant the
report keeps the tree sizes the budget rule chose and the verify-cost curve it used (measured on
this machine, refitted online). Prints markdown tables, writes the JSON report, and plots the cost
curves and the chosen sizes.

    python experiments/tree_bench.py --json runs/tree_bench.json --plot docs/tree_budget.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=12, help="how many built-in held-out prompts")
    parser.add_argument("--no-refiner", action="store_true", help="skip tree+refiner")
    parser.add_argument("--json", required=True, help="where to write the report")
    parser.add_argument("--plot", help="PNG: verify cost against tree size, and the sizes chosen, per batch size")
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.bench import Variant, run_variants
    from specjax.decode.engine import Engine
    from specjax.decode.tree import TreeConfig
    from specjax.io.registry import load_model, resolve_drafter, resolve_refiner

    model = load_model("smollm2")
    drafter = resolve_drafter("default", "smollm2")
    refiner = None if args.no_refiner else resolve_refiner("default", "smollm2")
    engine = Engine(model, drafter, refiner=refiner)
    prompts = [model.tokenizer.encode_chat(p) for p in HELDOUT_CHAT_PROMPTS[: args.prompts]]
    reports = {}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        variants = [Variant("ar", engine, "ar"), Variant("chain", engine, "chain"),
                    Variant("tree (auto)", engine, "tree"),
                    Variant("tree (16 nodes)", engine, "tree", (("tree", TreeConfig(budget=16)),))]
        if batch_size == 1:
            variants.append(Variant("tree (32 nodes)", engine, "tree", (("tree", TreeConfig(budget=32)),)))
            variants.append(Variant("tree (fixed, top-2 per depth)", engine, "tree",
                                    (("tree", TreeConfig(shape="fixed", width=2)),)))
            if refiner is not None:
                variants.append(Variant("tree+refiner (auto)", engine, "tree+refiner"))
                variants.append(Variant("chain+refiner", engine, "chain+refiner"))
        print(f"\n## batch {batch_size}", flush=True)
        report = run_variants(variants, prompts, args.max_new_tokens, batch_size=batch_size)
        reports[batch_size] = report
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(reports, indent=1))
        print_tables(report, drafter.config.block_size)
    if args.plot:
        plot(reports, args.plot)


def print_tables(report: dict, block_size: int) -> None:
    chain = report["methods"]["chain"]
    print("| variant | tokens/s (median) | vs ar | vs chain | tau | tau vs chain | nodes verified per step | "
          "acceptance at depth 1 / 2 / 3 | identical to ar |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, entry in report["methods"].items():
        tau = entry["tau"]
        tau_text = "-" if tau is None else f"{tau:.3f}"
        tau_ratio = "-" if tau is None else f"{tau / chain['tau']:.3f}x"
        accept = " / ".join(f"{a:.3f}" for a in entry["per_position_acceptance"][:3]) or "-"
        # A chain verifies the whole block every step.
        nodes = entry.get("tree_nodes_verified", float(block_size) if label.startswith("chain") else None)
        nodes_text = "-" if nodes is None else f"{nodes:.1f}"
        print(f"| {label} | {entry['tokens_per_s']:.1f} | {entry.get('speedup_vs_ar', 1.0):.2f}x | "
              f"{entry['tokens_per_s'] / chain['tokens_per_s']:.2f}x | {tau_text} | {tau_ratio} | {nodes_text} | "
              f"{accept} | {entry.get('identical_to_ar', '-')} |")
    for label, entry in report["methods"].items():
        if "tree_bucket_counts" not in entry:
            continue
        total = sum(entry["tree_bucket_counts"].values())
        shares = ", ".join(f"{size}: {count / total:.0%}" for size, count in entry["tree_bucket_counts"].items()
                           if count)
        model = entry["latency_model"]
        curve = ", ".join(f"{size}: {seconds * 1e3:.0f}" for size, seconds in zip(model["sizes"], model["verify_s"]))
        print(f"- {label}: rule chose {entry['tree_nodes_chosen']:.1f} nodes per step on average; verified "
              f"sizes {shares}; verify ms by size {curve}; fixed {model['fixed_s'] * 1e3:.1f} ms per step")


def plot(reports: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost_ax, size_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for batch_size, report in reports.items():
        entry = report["methods"].get("tree (auto)")
        if entry is None:
            continue
        model = entry["latency_model"]
        cost_ax.plot(model["sizes"], [s * 1e3 for s in model["verify_s"]], marker="o", label=f"batch {batch_size}")
        counts = entry["tree_bucket_counts"]
        total = sum(counts.values())
        sizes = [int(s) for s in counts]
        size_ax.plot(sizes, [counts[s] / total for s in counts], marker="o",
                     label=f"batch {batch_size} (mean chosen {entry['tree_nodes_chosen']:.1f})")
    cost_ax.set_xscale("log", base=2)
    cost_ax.set_xlabel("tree nodes verified (per row)")
    cost_ax.set_ylabel("verify pass, ms (measured)")
    cost_ax.set_title("verification cost on this machine")
    cost_ax.legend()
    size_ax.set_xscale("log", base=2)
    size_ax.set_xlabel("tree size verified (bucket)")
    size_ax.set_ylabel("share of verify steps")
    size_ax.set_title("sizes the budget rule chose")
    size_ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
