"""Side-by-side measurement of decoding methods on the same prompts, in one process.

Methods take turns prompt by prompt, so machine noise hits them alike. Compilation is excluded
(the Engine compiles ahead of time), and one untimed warm-up call per method absorbs first-run
allocation. Speedups are medians of per-call ratios against `ar`.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

import numpy as np

from specjax.decode.engine import Engine
from specjax.decode.sampling import SamplingConfig
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of a benchmark: a label, the engine and method that produce it, and extra
    `Engine.generate` options (e.g. refine=RefineConfig(3))."""

    label: str
    engine: Engine
    method: str
    options: tuple[tuple[str, Any], ...] = ()


def run_bench(engine: Engine, prompts: Sequence[Sequence[int]],
              methods: Sequence[str] | dict[str, str | tuple[str, dict]], max_new_tokens: int,
              sampling: SamplingConfig = SamplingConfig(), seed: int = 0, repeats: int = 1,
              progress: bool = True, options: dict[str, dict] | None = None,
              groups: Sequence[str] | None = None) -> dict:
    """Every method on every prompt with one engine. methods: method names, or labelled variants
    {label: method or (method, generate options)}; options: per-method generate options, for method
    names; groups: a label per prompt (its category), for a report per group besides the whole (see
    run_variants)."""
    if isinstance(methods, dict) and options:
        raise SpecjaxError("give labelled variants their options inside `methods`, not as keyword options")
    if not isinstance(methods, dict):
        methods = {m: (m, (options or {}).get(m, {})) for m in methods}
    variants = []
    for label, spec in methods.items():
        method, extra = (spec, {}) if isinstance(spec, str) else spec
        variants.append(Variant(label, engine, method, tuple(sorted(extra.items()))))
    report = run_variants(variants, prompts, max_new_tokens, sampling, seed, repeats, progress, groups=groups)
    report["precision"] = engine.precision  # every method ran this target: "identical" and speedups are at it
    return report


def run_variants(variants: Sequence[Variant], prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0, repeats: int = 1,
                 progress: bool = True, batch_size: int = 1, groups: Sequence[str] | None = None) -> dict:
    """Side-by-side runs of labelled variants (several engines allowed, e.g. one per refiner).
    A variant labelled "ar" is the baseline for speedups and output identity.

    batch_size > 1 decodes consecutive prompts together; the last batch wraps around to the first
    prompts so every call has the same shape (outputs are then reported once per call row).

    groups: one label per prompt (a held-out set's categories: chat, code, math, rewriting). The
    report then also holds report["groups"][label][variant]: the same figures over that group's
    prompts alone, because one mean tau over mixed kinds hides that math drafts well and chat does not.
    Batch size 1 only, so that every call is one prompt of one group."""
    from tqdm.auto import tqdm

    labels = [v.label for v in variants]
    _check_run(labels, prompts, batch_size, repeats, groups)
    num_calls = -(-len(prompts) // batch_size)
    batches = [[prompts[(c * batch_size + i) % len(prompts)] for i in range(batch_size)] for c in range(num_calls)]
    run = lambda v, batch: v.engine.generate(batch, max_new_tokens, sampling, seed=seed, method=v.method,
                                             **dict(v.options))
    for v in variants:  # warm-up (and compilation) outside the timing
        run(v, batches[0])
    tallies = {label: _Tally() for label in labels}
    with tqdm(total=repeats * len(batches) * len(variants), desc="bench", disable=not progress) as bar:
        for repeat in range(repeats):
            for call, batch in enumerate(batches):
                for v in variants:
                    tallies[v.label].add(call, run(v, batch), first_repeat=repeat == 0)
                    bar.update(1)
    report = {"max_new_tokens": max_new_tokens, "prompts": len(prompts), "batch_size": batch_size, "repeats": repeats,
              "temperature": sampling.temperature, "methods": {}}
    baseline = tallies.get(BASELINE_LABEL)
    for label, tally in tallies.items():
        entry = tally.entry()
        if baseline is not None and label != BASELINE_LABEL:
            entry["speedup_vs_ar"] = statistics.median(s / a for s, a in zip(tally.speeds, baseline.speeds))
            if sampling.greedy:
                entry["identical_to_ar"] = tally.outputs == baseline.outputs
        report["methods"][label] = entry
    if groups is not None:
        calls = {label: tally.calls for label, tally in tallies.items()}
        outputs = {label: tally.outputs for label, tally in tallies.items()}
        report["groups"] = {label: _group_entries(calls, outputs, labels, [g == label for g in groups], sampling.greedy)
                            for label in dict.fromkeys(groups)}
    return report


BASELINE_LABEL = "ar"
"""The variant label speedups and output identity are measured against."""


def _check_run(labels: Sequence[str], prompts, batch_size: int, repeats: int, groups) -> None:
    if len(set(labels)) != len(labels):
        raise SpecjaxError(f"benchmark labels must be distinct, got {labels}")
    if batch_size < 1:
        raise SpecjaxError(f"batch_size must be >= 1, got {batch_size}")
    if repeats < 1:
        raise SpecjaxError(f"repeats must be >= 1, got {repeats}")
    if not prompts:
        raise SpecjaxError("the benchmark needs at least one prompt")
    if groups is not None:
        if len(groups) != len(prompts):
            raise SpecjaxError(f"groups needs one label per prompt: {len(groups)} labels for {len(prompts)} prompts")
        if batch_size != 1:
            raise SpecjaxError("a report per group needs batch_size 1 (a call of several prompts mixes groups)")


class _Tally:
    """One variant's figures summed over its calls, and its report entry."""

    def __init__(self):
        self.calls: list = []  # per call: (batch index, tokens/s, accepted-length histogram or None)
        self.outputs: list = []
        self.histogram = None
        self.walls = {"draft_s": 0.0, "verify_s": 0.0, "refine_s": 0.0, "wall_s": 0.0}
        self.passes: list[float] = []
        self.lossy: str | None = None
        self.tree_sizes: dict = {"chosen": [], "verified": [], "buckets": {}}
        self.auto: dict | None = None  # the auto method's policy steps over every call, and its last cost ratio

    @property
    def speeds(self) -> list[float]:
        return [speed for _, speed, _ in self.calls]

    def add(self, call: int, result, first_repeat: bool) -> None:
        stats = result.stats
        self.calls.append((call, stats["tokens_per_s"], stats.get("accepted_length_histogram")))
        if first_repeat:
            self.outputs.extend(result.tokens)
        self.walls["wall_s"] += stats["wall_s"]
        if "accepted_length_histogram" in stats:
            h = np.asarray(stats["accepted_length_histogram"])
            self.histogram = h if self.histogram is None else self.histogram + h
            for key in ("draft_s", "verify_s", "refine_s"):
                self.walls[key] += stats.get(key, 0.0)
        if "refine_passes" in stats:
            self.passes.append(stats["refine_passes"])
        self.lossy = stats.get("lossy", self.lossy)
        if "auto" in stats:
            self.auto = self.auto or {"policy_steps": {}}
            for name, n in stats["auto"]["policy_steps"].items():
                self.auto["policy_steps"][name] = self.auto["policy_steps"].get(name, 0) + n
            self.auto["chain_step_over_decode_step"] = stats["auto"]["chain_step_over_decode_step"]
        if "tree_bucket_counts" in stats:
            sizes = self.tree_sizes
            sizes["chosen"].append(stats["tree_nodes_chosen"])
            sizes["verified"].append(stats["tree_nodes_verified"])
            for size, count in stats["tree_bucket_counts"].items():
                sizes["buckets"][size] = sizes["buckets"].get(size, 0) + count
            if "latency_model" in stats:  # auto-sized trees only; a fixed budget has none
                sizes["latency_model"] = stats["latency_model"]

    def entry(self) -> dict:
        entry = {"tokens_per_s": statistics.median(self.speeds), "tau": None, "per_position_acceptance": [],
                 "outputs": self.outputs}
        if self.histogram is not None and self.histogram.sum():
            entry.update(_acceptance(self.histogram))
            # Each phase's share of the modelled step time. The phases are timed alone and scaled
            # by the steps run, because the loop is one fused program; their sum can exceed the
            # fused loop's wall time, so a share of the wall time could pass 1.
            modelled = sum(self.walls[f"{key}_s"] for key in ("draft", "verify", "refine"))
            for key in ("draft", "verify", "refine"):
                entry[f"{key}_fraction"] = self.walls[f"{key}_s"] / modelled if modelled else 0.0
        if self.passes:
            entry["refine_passes"] = float(np.mean(self.passes))
        if self.lossy is not None:
            entry["lossy"] = self.lossy
        if self.auto is not None:
            entry["auto"] = self.auto
        sizes = self.tree_sizes
        if sizes["chosen"]:
            entry["tree_nodes_chosen"] = float(np.mean(sizes["chosen"]))
            entry["tree_nodes_verified"] = float(np.mean(sizes["verified"]))
            entry["tree_bucket_counts"] = sizes["buckets"]
            if "latency_model" in sizes:
                entry["latency_model"] = sizes["latency_model"]
        return entry


def _acceptance(hist: np.ndarray) -> dict:
    """tau and per-position acceptance from an accepted-length histogram (index i: i + 1 tokens a step)."""
    steps = hist.sum()
    return {"tau": float((hist * (np.arange(len(hist)) + 1)).sum() / steps),
            "per_position_acceptance": (hist[::-1].cumsum()[::-1][1:] / steps).tolist(),
            "accepted_length_histogram": hist.tolist()}


def _group_entries(calls: dict, outputs: dict, labels: Sequence[str], members: Sequence[bool], greedy: bool) -> dict:
    """Each variant's figures over the calls (prompts, at batch size 1) whose `members` flag is set."""
    entries = {}
    for method in labels:
        mine = [(call, speed, hist) for call, speed, hist in calls[method] if members[call]]
        entry = {"prompts": sum(members), "tokens_per_s": statistics.median(s for _, s, _ in mine), "tau": None}
        hists = [np.asarray(h) for _, _, h in mine if h is not None]
        if hists and sum(hists).sum():
            entry.update(_acceptance(sum(hists)))
        if BASELINE_LABEL in labels and method != BASELINE_LABEL:
            ar = [s for call, s, _ in calls[BASELINE_LABEL] if members[call]]
            entry["speedup_vs_ar"] = statistics.median(s / a for (_, s, _), a in zip(mine, ar))
            if greedy:
                entry["identical_to_ar"] = all(outputs[method][i] == outputs[BASELINE_LABEL][i]
                                               for i, member in enumerate(members) if member)
        entries[method] = entry
    return entries


def format_table(report: dict) -> str:
    width = max([10] + [len(m) for m in report["methods"]] + [len(m) + 2 for m in report["methods"] if "groups" in report])
    lines = [f"{'method':{width}s} {'tokens/s':>9s} {'speedup':>8s} {'tau':>6s} {'nodes':>6s}  per-position acceptance"]
    for method, entry in report["methods"].items():
        speedup = f"{entry['speedup_vs_ar']:.2f}x" if "speedup_vs_ar" in entry else "-"
        tau = f"{entry['tau']:.2f}" if entry["tau"] is not None else "-"
        # Tree methods: mean nodes verified per step.
        nodes = f"{entry['tree_nodes_verified']:.1f}" if "tree_nodes_verified" in entry else "-"
        accept = " ".join(f"{a:.2f}" for a in entry["per_position_acceptance"][:8])
        lines.append(f"{method:{width}s} {entry['tokens_per_s']:9.1f} {speedup:>8s} {tau:>6s} {nodes:>6s}  {accept}"
                     + (f"  LOSSY: {entry['lossy']}" if "lossy" in entry else ""))
    for group, entries in report.get("groups", {}).items():
        prompts = next(iter(entries.values()))["prompts"]
        lines.append(f"  {group} ({prompts} prompt{'s' if prompts != 1 else ''}):")
        for method, entry in entries.items():
            speedup = f"{entry['speedup_vs_ar']:.2f}x" if "speedup_vs_ar" in entry else "-"
            tau = f"{entry['tau']:.2f}" if entry["tau"] is not None else "-"
            lines.append(f"{'  ' + method:{width}s} {entry['tokens_per_s']:9.1f} {speedup:>8s} {tau:>6s}")
    if "long_context" in report:
        from specjax.data.retrieval import describe_long_context

        lines.append(f"(one long-context request: {describe_long_context(report['long_context'])})")
    if "precision" in report:
        p = report["precision"]
        rows = (f", every forward padded to {p['query_rows']} query rows, so a step verifies at most "
                f"{p['query_rows']}" if p["query_rows"] else "")
        lines.append(f"(computed in {p['dtype']}, KV cache in {p['kv_dtype']}{rows})")
    return "\n".join(lines)
