"""Plots of the memory figures decoding reports (specjax/decode/memory.py computes them)."""

from __future__ import annotations


def plot_memory_report(report: dict, path) -> None:
    """Bytes against context length: target KV, drafter state (full, windowed) and drafting-step peaks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = lambda values: [v / 2**20 if v is not None else float("nan") for v in values]  # noqa: E731
    contexts = report["contexts"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(contexts, mib(report["target_kv_bytes"]), "k-o", label="target KV cache")
    ax.plot(contexts, mib(report["drafter_kv_bytes"]["full"]), "C0-o", label="drafter state, full attention")
    ax.plot(contexts, mib(report["drafter_kv_bytes"]["windowed"]), "C1-o", label="drafter state, windowed")
    for name, colour in (("full", "C0"), ("windowed", "C1")):
        above = [p - report["weights_bytes"][name] if p is not None else None for p in report["peak_bytes"][name]]
        ax.plot(contexts, mib(above), f"{colour}--s", label=f"drafting step peak above weights, {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("MiB (batch %d)" % report["batch"])
    w = report["window"]
    ax.set_title(f"KV memory against context (window {w['window']}, segment {w['segment']}, "
                 f"{w['summaries']} summaries)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
