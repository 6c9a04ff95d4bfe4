# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Windowed drafting: bounded drafter memory at long context
#
# A block-diffusion drafter reads the target's hidden features of the whole context, so with full
# attention its context state (keys and values of every position) grows by a fixed number of bytes
# per token. SW-SpeedDLM-style **windowed drafting** bounds it: the drafter attends to the last *W*
# positions raw, plus a few learned **summary tokens** for each finished segment of older context,
# made by a small trained segment compressor. Its state is then a ring of *W* + one block, plus
# summaries that grow *segment / summaries* times slower than the raw context.
#
# Only the drafts change: the target still verifies every block against the whole context, so the
# greedy output stays the target's own, token for token. What windowing can cost is acceptance.
#
# This notebook runs SmolLM2-135M with its committed drafter and committed compressor (window 256,
# segment 128, 2 summaries) and measures:
# - the **drafter's context state** (bytes) against context length, full attention against
#   windowed, as decoding allocates it, and the **peak of one compiled drafting step** on this backend;
# - one **long-ish prompt** (a passage of *Persuasion*, held out from the drafter's training) decoded
#   by AR, by chain drafting with the full-attention drafter, and by chain drafting with the windowed
#   drafter: **tau** for both, and whether both outputs are **identical to AR**.

# %%
# Install specjax from the checkout this notebook sits in; elsewhere (Colab) from SPECJAX_REPO.
SPECJAX_REPO = "git+https://github.com/specjax/specjax"  # your fork, if you have one
import importlib.util, pathlib, subprocess, sys  # noqa: E401
if importlib.util.find_spec("specjax") is None:
    here = pathlib.Path.cwd().resolve()
    root = next((d for d in (here, *here.parents) if (d / "pyproject.toml").exists() and (d / "specjax").is_dir()), None)
    source = ["-e", str(root)] if root else [SPECJAX_REPO]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *source], check=True)
    print("installed specjax from", source[-1])
from specjax.notebook import setup  # noqa: E402
ENV = setup()

# %% tags=["parameters"]
CONTEXTS = [512, 1024, 2048, 4096, 8192]  # context lengths (tokens) of the memory curves
WINDOW = 256                               # raw context positions the windowed drafter attends to
PROMPT_TOKENS = 1024                       # tokens of the passage decoded below
MAX_NEW_TOKENS = 64                        # new tokens decoded after it

# %%
import matplotlib.pyplot as plt
import numpy as np

import specjax
from specjax.notebook import summary

# The same committed drafter twice: with full attention, and windowed with the committed compressor.
llm = specjax.LLM("smollm2", dtype=ENV.dtype, refiner=None)
windowed_llm = specjax.LLM("smollm2", dtype=ENV.dtype, refiner=None, drafter_window=WINDOW)
model, full, windowed = llm.model, llm.drafter, windowed_llm.drafter
w = windowed.config.window
print(f"drafter: {full.config.num_layers} layer, block {full.config.block_size}; windowed: window {w.window}, "
      f"segment {w.segment}, {w.summaries} summary tokens per finished segment")

# %% [markdown]
# ## Drafter memory against context length
# `drafter_memory` sizes the drafter's context state as decoding allocates it (shapes only, exact
# bytes), and compiles (never runs) one drafting step at each length to read the peak of the
# program's buffers as XLA assigned them on this backend. The step's weights (the drafter and the
# token embedding it reads) are a constant part of that peak, so it is plotted above them.
#
# The windowed state is not zero at short context: it holds a ring of *W* + one block positions'
# keys and values, and the pre-norm states of the last two segments (the compressor reads a segment
# once it is finished), whatever the context. Past a crossover of a few hundred tokens it is the
# smaller, and from then on only the summaries grow.

# %%
report = windowed_llm.drafter_memory(CONTEXTS)
mib = lambda values: np.asarray([np.nan if v is None else v / 2**20 for v in values], float)  # noqa: E731
state = {name: mib(report["drafter_kv_bytes"][name]) for name in ("full", "windowed")}
peak = {name: mib(report["peak_bytes"][name]) - report["weights_bytes"][name] / 2**20 for name in ("full", "windowed")}
print("| context (tokens) | drafter state, full (MiB) | drafter state, windowed (MiB) | full / windowed | "
      "step peak above weights, full (MiB) | windowed (MiB) |")
print("|---|---|---|---|---|---|")
for i, n in enumerate(CONTEXTS):
    print(f"| {n} | {state['full'][i]:.3f} | {state['windowed'][i]:.3f} | {state['full'][i] / state['windowed'][i]:.2f}x "
          f"| {peak['full'][i]:.2f} | {peak['windowed'][i]:.2f} |")
print(f"target KV cache at {CONTEXTS[-1]} tokens, for scale: {report['target_kv_bytes'][-1] / 2**20:.1f} MiB "
      f"(the drafter's is {report['drafter_kv_bytes']['full'][-1] / report['target_kv_bytes'][-1]:.1%} of it: "
      f"{full.config.num_layers} drafter layer against {model.config.num_layers} target layers)")
print("peaks:", report["peak_source"])

# %% [markdown]
# ## One long prompt, decoded three ways
# A passage of *Persuasion* (held out from the drafter's and the compressor's training), as raw text
# for the model to continue. Each `bench` alternates AR and chain on it, keeps compilation out of
# the timing, and compares the chain's output with AR's.

# %%
book = next(d for d in specjax.load_corpus("austen") if d.title == "Persuasion").text
start = book.index("\n\n", len(book) // 3) + 2  # a paragraph a third of the way in
passage = model.tokenizer.encode(book[start:], add_special_tokens=False)[:PROMPT_TOKENS]
print(f"prompt: {len(passage)} tokens of Persuasion, from {model.tokenizer.decode(passage[:16])!r} ...")
bench = llm.bench([passage], ("ar", "chain"), MAX_NEW_TOKENS, progress=False)
windowed_bench = windowed_llm.bench([passage], {"ar": "ar", f"chain, window {WINDOW}": "chain"}, MAX_NEW_TOKENS,
                                    progress=False)
print(bench, windowed_bench, sep="\n")
chain, windowed_chain = bench["methods"]["chain"], windowed_bench["methods"][f"chain, window {WINDOW}"]

# %% [markdown]
# What the two decodes allocated for the drafter (their `stats["memory"]`), and the figure.

# %%
used = {}
for name, one in (("full", llm), ("windowed", windowed_llm)):
    [out] = one.generate(passage, MAX_NEW_TOKENS, method="chain")
    stats = out.metrics["batch"]["memory"]
    used[name] = (stats["cache_length"], stats["drafter_state_bytes"])
    print(f"{name:>8}: drafter state {stats['drafter_state_bytes'] / 2**20:.3f} MiB for a cache of "
          f"{stats['cache_length']} positions ({stats['drafter_attention']} attention)")

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
for name, colour, label in (("full", "tab:blue", "full attention"), ("windowed", "tab:orange", f"windowed (W = {WINDOW})")):
    left.plot(CONTEXTS, state[name], "-o", color=colour, label=label)
    left.plot(*[[v] for v in (used[name][0], used[name][1] / 2**20)], "*", ms=14, color=colour,
              markeredgecolor="black", label=f"{label}: the decode above (cache of {used[name][0]} positions)")
    right.plot(CONTEXTS, peak[name], "-s", color=colour, label=label)
left.set(xlabel="context length (tokens)", ylabel="drafter context state (MiB, batch 1)",
         title=f"Drafter KV memory ({ENV.dtype})")
right.set(xlabel="context length (tokens)", ylabel="MiB above the weights (batch 1)",
          title=f"Peak of one compiled drafting step ({ENV.backend})")
for ax in (left, right):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Acceptance and exactness
# Both drafters are verified by the same target, so both outputs must be AR's. tau is the tokens
# committed per target pass; the windowed drafter sees less of the context, so it may accept fewer.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
labels = ["full attention", f"windowed (W = {WINDOW})"]
taus = [chain["tau"], windowed_chain["tau"]]
ax.bar(labels, taus, color=["tab:blue", "tab:orange"])
for x, (t, m) in enumerate(zip(taus, (chain, windowed_chain))):
    ax.text(x, t, f"tau {t:.2f}\n{'identical to AR' if m['identical_to_ar'] else 'DIFFERS from AR'}",
            ha="center", va="bottom", fontsize=9)
ax.set(ylabel="tau (tokens per target pass)", ylim=(0, max(taus) * 1.35),
       title=f"Chain drafting after a {len(passage)}-token passage")
plt.tight_layout()
plt.show()
print(f"windowed / full tau: {windowed_chain['tau'] / chain['tau']:.3f}")
print("continuation:", model.tokenizer.decode(bench["methods"]["ar"]["outputs"][0]).strip()[:300])

# %%
summary(window=WINDOW, contexts=CONTEXTS, prompt_tokens=len(passage),
        drafter_state_mib_full=state["full"].tolist(), drafter_state_mib_windowed=state["windowed"].tolist(),
        memory_ratio_at_longest=float(state["full"][-1] / state["windowed"][-1]),
        step_peak_mib_full=peak["full"].tolist(), step_peak_mib_windowed=peak["windowed"].tolist(),
        tau_full=chain["tau"], tau_windowed=windowed_chain["tau"],
        identical_to_ar_full=chain["identical_to_ar"], identical_to_ar_windowed=windowed_chain["identical_to_ar"],
        tokens_per_s_ar=bench["methods"]["ar"]["tokens_per_s"], tokens_per_s_full=chain["tokens_per_s"],
        tokens_per_s_windowed=windowed_chain["tokens_per_s"])
