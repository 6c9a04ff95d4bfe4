"""Two or more drafters for one target, decoded side by side on the same prompts in one run.

    python experiments/drafter_compare.py old=runs/drafter-v1 new=runs/drafter-v2/drafter \
        [--max-new-tokens 128] [--prompts 12] [--category chat] [--json out.json] \
        [--dtype float32|bfloat16] [--methods chain,tree,chain+refiner] [--refine-slots 0,3] [--speed-baselines] \
        [--ngram]

A drafter given as `label=folder:refiner_folder` (or `label=default:default`) brings its refiner
for the +refiner methods; a drafter without one skips them.

Greedy, batch 1, SmolLM2 at `--dtype` (bf16 with its steps padded to 8 query rows, the exactness
reference). The AR variant at that precision is the baseline for output identity; each drafter
runs each of `--methods` ("chain <label>", "tree <label>"). `--speed-baselines` adds AR at the
other settings this machine has (float32 one row, bf16 one row) and prints every method's speedup
against the fastest AR measured in the run, the issue's speed baseline. Prompts are the first `--prompts`
of the held-out set's `--category` (specjax/data/heldout_prompts.jsonl), or of each category with
`--category all`, reported per category too; `--category sharegpt` takes the opening requests of
ShareGPT's held-out conversations instead (data/sharegpt.py). `--ngram` adds prompt lookup, the
draft-free baseline every drafter is read against. tau and acceptance do
not depend on timing, so they stay valid when the machine is shared; tokens/s and speedups are
only worth reporting from a run that had the cores to itself.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+",
                        help="label=folder (a DFlash-format drafter) or label=default, optionally :refiner_folder")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--category", default="chat",
                        help="held-out category: chat, code, math or rewrite; or all: the first --prompts of each, "
                             "reported per category as well; or sharegpt: held-out ShareGPT opening requests")
    parser.add_argument("--ngram", action="store_true", help="also run the ngram (prompt lookup) method")
    parser.add_argument("--json", help="also write the whole report here")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--methods", default="chain", help="comma-separated speculative methods per drafter")
    parser.add_argument("--refine-slots", default="0",
                        help="comma-separated RefineConfig.slots values: each +refiner method runs once per "
                             "value (0: every slot), labelled with it when there are several")
    parser.add_argument("--speed-baselines", action="store_true",
                        help="also time AR in float32 and in bf16 without padded rows")
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CATEGORIES, heldout_prompts
    from specjax.decode.bench import Variant, format_table, run_variants
    from specjax.decode.engine import Engine
    from specjax.decode.refine import RefineConfig
    from specjax.decode.slots import SLOT_METHODS
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter, resolve_refiner, with_query_rows

    refine_slots = [int(v) for v in args.refine_slots.split(",")]
    base = load_model("smollm2")
    model = with_query_rows(at_compute_dtype(base, args.dtype), "auto")
    categories = HELDOUT_CATEGORIES if args.category == "all" else (args.category,)
    if args.category == "sharegpt":
        from specjax.data.sharegpt import sharegpt_requests

        texts = [("sharegpt", r.messages[-1]["content"]) for r in sharegpt_requests("heldout", "first")[: args.prompts]]
    else:
        texts = [(c, p) for c in categories for p in heldout_prompts(c)[: args.prompts]]
    prompts = [model.tokenizer.encode_chat(p) for _, p in texts]
    groups = [c for c, _ in texts] if len(categories) > 1 else None
    variants = [Variant("ar", Engine(model), "ar")]
    if args.speed_baselines:
        for dtype in ("float32", "bfloat16"):
            one_row = with_query_rows(at_compute_dtype(base, dtype), 0)
            if one_row.config != model.config:
                variants.append(Variant(f"ar {dtype} one row", Engine(one_row), "ar"))
    if args.ngram:
        variants.append(Variant("ngram", variants[0].engine, "ngram"))
    for spec in args.drafters:
        label, _, folder = spec.partition("=")
        folder, _, refiner_folder = folder.partition(":")
        if not folder:
            parser.error(f"give drafters as label=folder[:refiner_folder], got {spec!r}")
        refiner = resolve_refiner(refiner_folder, "smollm2") if refiner_folder else None
        engine = Engine(model, at_compute_dtype(resolve_drafter(folder, "smollm2"), args.dtype), refiner=refiner)
        for method in args.methods.split(","):
            needs_refiner = method in SLOT_METHODS and SLOT_METHODS[method].needs_refiner
            if needs_refiner and refiner is None:
                print(f"{label}: no refiner given (label=folder:refiner_folder), so no {method}", flush=True)
                continue
            if not needs_refiner:
                variants.append(Variant(f"{method} {label}", engine, method))
                continue
            for slots in refine_slots:
                suffix = f" ({slots or 'all'} slots)" if len(refine_slots) > 1 else ""
                variants.append(Variant(f"{method} {label}{suffix}", engine, method,
                                        (("refine", RefineConfig(slots=slots)),)))
    report = run_variants(variants, prompts, args.max_new_tokens, groups=groups)
    print(format_table(report))
    for label, entry in report["methods"].items():
        if not label.startswith("ar"):
            print(f"{label}: identical to AR at {args.dtype} on every prompt: {entry['identical_to_ar']}")
    fastest = max((label for label in report["methods"] if label.startswith("ar")),
                  key=lambda label: report["methods"][label]["tokens_per_s"])
    best = report["methods"][fastest]["tokens_per_s"]
    print(f"fastest AR in this run: {fastest} at {best:.1f} tokens/s")
    for label, entry in report["methods"].items():
        print(f"  {label}: {entry['tokens_per_s'] / best:.2f}x the fastest AR")
    for group, entries in report.get("groups", {}).items():
        fastest = max((label for label in entries if label.startswith("ar")), key=lambda x: entries[x]["tokens_per_s"])
        print(f"{group}: fastest AR {fastest} at {entries[fastest]['tokens_per_s']:.1f} tokens/s; "
              + ", ".join(f"{label} {entry['tokens_per_s'] / entries[fastest]['tokens_per_s']:.2f}x"
                          + (f" (tau {entry['tau']:.2f})" if entry["tau"] else "")
                          for label, entry in entries.items() if not label.startswith("ar")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
