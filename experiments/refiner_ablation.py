"""Refiner ablation on SmolLM2: design x refinement passes -> tau and tokens/s, all in one run.

Every variant decodes the same held-out chat prompts, taking turns prompt by prompt (see
specjax.decode.bench.run_variants), with `ar` and plain `chain` as baselines. Writes the full
report as JSON, prints a markdown table, and plots per-position acceptance with and without
each refiner.

    python experiments/refiner_ablation.py --refiner transformer=runs/refiner-transformer/refiner \\
        --refiner gru=runs/refiner-gru/refiner --passes 1,2,4 --json runs/refiner_ablation.json \\
        --plot docs/refiner_acceptance.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refiner", action="append", required=True, help="LABEL=FOLDER (repeatable)")
    parser.add_argument("--passes", default="1,2,4", help="comma-separated max refinement passes (adaptive)")
    parser.add_argument("--keep-confident", default="0", help="comma-separated RefineConfig.keep_confident values")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=12, help="how many built-in held-out prompts")
    parser.add_argument("--json", required=True, help="where to write the report")
    parser.add_argument("--plot", help="PNG of per-position acceptance curves")
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.bench import Variant, run_variants
    from specjax.decode.engine import Engine
    from specjax.decode.refine import RefineConfig
    from specjax.io.refiner import load_refiner
    from specjax.io.registry import load_model, resolve_drafter

    model = load_model("smollm2")
    drafter = resolve_drafter("default", "smollm2")
    base = Engine(model, drafter)
    variants = [Variant("ar", base, "ar"), Variant("chain", base, "chain")]
    for spec in args.refiner:
        label, _, folder = spec.partition("=")
        engine = Engine(model, drafter, refiner=load_refiner(folder))
        for passes in (int(p) for p in args.passes.split(",")):
            for keep in (float(k) for k in args.keep_confident.split(",")):
                name = f"{label} R={passes}" + (f" keep>={keep:g}" if keep else "")
                variants.append(Variant(name, engine, "chain+refiner",
                                        (("refine", RefineConfig(max_passes=passes, keep_confident=keep)),)))
    prompts = [model.tokenizer.encode_chat(p) for p in HELDOUT_CHAT_PROMPTS[: args.prompts]]
    report = run_variants(variants, prompts, args.max_new_tokens)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))

    chain = report["methods"]["chain"]
    print("| variant | tokens/s | vs ar | vs chain | tau | tau vs chain | passes/block | refine share | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, entry in report["methods"].items():
        tau = entry["tau"]
        tau_text = "-" if tau is None else f"{tau:.3f}"
        tau_ratio = "-" if tau is None else f"{tau / chain['tau']:.3f}x"
        passes = entry.get("refine_passes")
        passes_text = "-" if passes is None else f"{passes:.2f}"
        print(f"| {label} | {entry['tokens_per_s']:.1f} | {entry.get('speedup_vs_ar', 1.0):.2f}x | "
              f"{entry['tokens_per_s'] / chain['tokens_per_s']:.2f}x | {tau_text} | {tau_ratio} | {passes_text} | "
              f"{entry.get('refine_fraction', 0):.1%} | {entry.get('identical_to_ar', '-')} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, entry in report["methods"].items():
            if entry["per_position_acceptance"]:
                curve = entry["per_position_acceptance"][:8]
                ax.plot(range(1, len(curve) + 1), curve, marker="o", label=f"{label} (tau {entry['tau']:.2f})",
                        linewidth=2.5 if label == "chain" else 1.2)
        ax.set_yscale("log")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("fraction of verify steps accepting >= k drafts")
        ax.set_title(f"SmolLM2 greedy, {len(prompts)} held-out chat prompts x {args.max_new_tokens} tokens")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
