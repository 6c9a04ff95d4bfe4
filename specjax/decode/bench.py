"""Side-by-side measurement of decoding methods on the same prompts, in one process.

Methods take turns prompt by prompt, so machine noise hits them alike. Compilation is excluded
(the Engine compiles ahead of time), and one untimed warm-up call per method absorbs first-run
allocation. Speedups are medians of per-prompt ratios against `ar`.
"""

from __future__ import annotations

import statistics
from typing import Sequence

import numpy as np

from specjax.decode.engine import Engine
from specjax.decode.sampling import SamplingConfig


def run_bench(engine: Engine, prompts: Sequence[Sequence[int]], methods: Sequence[str], max_new_tokens: int,
              sampling: SamplingConfig = SamplingConfig(), seed: int = 0, repeats: int = 1,
              progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    for method in methods:  # warm-up (and compilation) outside the timing
        engine.generate([prompts[0]], max_new_tokens, sampling, seed=seed, method=method)
    speeds = {m: [] for m in methods}
    outputs = {m: [] for m in methods}
    histograms = {m: None for m in methods}
    walls = {m: {"draft_s": 0.0, "verify_s": 0.0, "wall_s": 0.0} for m in methods}
    with tqdm(total=repeats * len(prompts) * len(methods), desc="bench", disable=not progress) as bar:
        for repeat in range(repeats):
            for prompt in prompts:
                for method in methods:
                    result = engine.generate([prompt], max_new_tokens, sampling, seed=seed, method=method)
                    speeds[method].append(result.stats["tokens_per_s"])
                    if repeat == 0:
                        outputs[method].append(result.tokens[0])
                    walls[method]["wall_s"] += result.stats["wall_s"]
                    if "accepted_length_histogram" in result.stats:
                        h = np.asarray(result.stats["accepted_length_histogram"])
                        histograms[method] = h if histograms[method] is None else histograms[method] + h
                        walls[method]["draft_s"] += result.stats["draft_s"]
                        walls[method]["verify_s"] += result.stats["verify_s"]
                    bar.update(1)
    report = {"max_new_tokens": max_new_tokens, "prompts": len(prompts), "repeats": repeats,
              "temperature": sampling.temperature, "methods": {}}
    for method in methods:
        entry = {"tokens_per_s": statistics.median(speeds[method]), "tau": None, "per_position_acceptance": [],
                 "outputs": outputs[method]}
        hist = histograms[method]
        if hist is not None and hist.sum():
            steps = hist.sum()
            entry["tau"] = float((hist * (np.arange(len(hist)) + 1)).sum() / steps)
            entry["per_position_acceptance"] = (hist[::-1].cumsum()[::-1][1:] / steps).tolist()
            entry["accepted_length_histogram"] = hist.tolist()
            entry["draft_fraction"] = walls[method]["draft_s"] / walls[method]["wall_s"]
            entry["verify_fraction"] = walls[method]["verify_s"] / walls[method]["wall_s"]
        if "ar" in methods and method != "ar":
            entry["speedup_vs_ar"] = statistics.median(
                s / a for s, a in zip(speeds[method], speeds["ar"]))
            if sampling.greedy:
                entry["identical_to_ar"] = outputs[method] == outputs["ar"]
        report["methods"][method] = entry
    return report


def format_table(report: dict) -> str:
    lines = [f"{'method':10s} {'tokens/s':>9s} {'speedup':>8s} {'tau':>6s}  per-position acceptance"]
    for method, entry in report["methods"].items():
        speedup = f"{entry['speedup_vs_ar']:.2f}x" if "speedup_vs_ar" in entry else "-"
        tau = f"{entry['tau']:.2f}" if entry["tau"] is not None else "-"
        accept = " ".join(f"{a:.2f}" for a in entry["per_position_acceptance"][:8])
        lines.append(f"{method:10s} {entry['tokens_per_s']:9.1f} {speedup:>8s} {tau:>6s}  {accept}")
    return "\n".join(lines)
