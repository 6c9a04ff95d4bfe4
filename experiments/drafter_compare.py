"""Two or more drafters for one target, decoded side by side on the same prompts in one run.

    python experiments/drafter_compare.py old=runs/drafter-v1 new=runs/drafter-v2/drafter \
        [--max-new-tokens 128] [--prompts 12] [--category chat] [--json out.json]

Greedy, batch 1, SmolLM2 in float32. The AR variant is the baseline for speedups and output
identity; each drafter runs the chain method ("chain <label>"). Prompts are the first `--prompts`
of the held-out set's `--category` (specjax/data/heldout_prompts.jsonl). tau and acceptance do
not depend on timing, so they stay valid when the machine is shared; tokens/s and speedups are
only worth reporting from a run that had the cores to itself.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="label=folder (a DFlash-format drafter), or label=default")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--category", default="chat", help="held-out category: chat, code, math or rewrite")
    parser.add_argument("--json", help="also write the whole report here")
    args = parser.parse_args()

    from specjax.data.prompts import heldout_prompts
    from specjax.decode.bench import Variant, format_table, run_variants
    from specjax.decode.engine import Engine
    from specjax.io.registry import load_model, resolve_drafter

    model = load_model("smollm2")
    prompts = [model.tokenizer.encode_chat(p) for p in heldout_prompts(args.category)[: args.prompts]]
    variants = [Variant("ar", Engine(model), "ar")]
    for spec in args.drafters:
        label, _, folder = spec.partition("=")
        if not folder:
            parser.error(f"give drafters as label=folder, got {spec!r}")
        variants.append(Variant(f"chain {label}", Engine(model, resolve_drafter(folder, "smollm2")), "chain"))
    report = run_variants(variants, prompts, args.max_new_tokens)
    print(format_table(report))
    for label, entry in report["methods"].items():
        if label != "ar":
            print(f"{label}: identical to AR on every prompt: {entry['identical_to_ar']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
