"""What one tree step costs inside the decode loop, by tree size, against the verify pass timed
alone (the latency model the budget rule reads). SmolLM2 with the committed drafter, batch 1, the
held-out chat prompts, every variant side by side in one run (decode.bench.run_variants):

- trees of a fixed 1, 2, 4 and 8 nodes (one compiled bucket each, so no `lax.switch`);
- the auto tree over those buckets, whose steps pick a bucket through `lax.switch` (under
  padded query rows, bf16's default, an auto tree now keeps only its largest bucket within them,
  `TreeConfig.within_query_rows`, so there this row measures the tree `--method tree` runs);
- ar and chain as baselines.

Per-step milliseconds are wall seconds over verify steps (prefill included, as every variant pays
it alike). With --dtype bfloat16 every forward is padded to 8 query rows (registry.PADDED_QUERY_ROWS;
16 before 2026-12-06), so a verify pass of 1 to 8 nodes runs the same shapes: a cost that grows
with the size is outside the target's forward. A fixed tree larger than the padded rows is refused.

    python experiments/tree_step_probe.py --dtype bfloat16 [--prompts 6] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sizes", default="1,2,4,8", help="fixed tree sizes; also the auto tree's buckets")
    parser.add_argument("--json", help="where to write the report")
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.bench import Variant, run_variants
    from specjax.decode.engine import Engine
    from specjax.decode.tree import TreeConfig
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter, with_query_rows

    model = with_query_rows(at_compute_dtype(load_model("smollm2"), args.dtype), "auto")
    drafter = at_compute_dtype(resolve_drafter("default", "smollm2"), args.dtype)
    engine = Engine(model, drafter)
    prompts = [model.tokenizer.encode_chat(p) for p in HELDOUT_CHAT_PROMPTS[: args.prompts]]
    sizes = tuple(int(s) for s in args.sizes.split(","))
    variants = [Variant("ar", engine, "ar"), Variant("chain", engine, "chain")]
    variants += [Variant(f"tree@{n}", engine, "tree", (("tree", TreeConfig(budget=n)),)) for n in sizes]
    variants.append(Variant("tree auto", engine, "tree", (("tree", TreeConfig(buckets=sizes)),)))
    report = run_variants(variants, prompts, args.max_new_tokens)
    print(f"\n{args.dtype}, query rows {model.config.query_rows}, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    print("| variant | tokens/s | tau | ms per step | identical to ar |")
    print("|---|---|---|---|---|")
    for label, entry in report["methods"].items():
        tau = entry["tau"] or 1.0
        print(f"| {label} | {entry['tokens_per_s']:.1f} | {tau:.2f} | {1e3 * tau / entry['tokens_per_s']:.1f} | "
              f"{entry.get('identical_to_ar', '-')} |")
    auto = report["methods"]["tree auto"]
    model_used = auto["latency_model"]
    print("- the auto tree's latency model (ms): verify " + ", ".join(
        f"{s}: {1e3 * v:.1f}" for s, v in zip(model_used["sizes"], model_used["verify_s"]))
        + f"; fixed {1e3 * model_used['fixed_s']:.1f}; buckets verified {auto['tree_bucket_counts']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
