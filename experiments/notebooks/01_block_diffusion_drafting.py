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
# # Block-diffusion drafting, in miniature
#
# A DFlash-style drafter is a small transformer that reads the target's hidden features and fills a
# whole block of masked slots in **one** forward pass. The target then checks the block in one
# forward pass of its own and keeps the longest prefix it agrees with, plus one token of its own.
# With greedy decoding the output is the target's own greedy output, token for token.
#
# This notebook runs SmolLM2-135M with its committed drafter (1 layer, block 8) and measures:
# - **tau**, the tokens committed per target pass;
# - **per-position acceptance**: how often draft slot *k* survives verification;
# - the **speedup** over autoregressive decoding, timed side by side on this machine;
# - a picture of one verified block.

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
PROMPTS = 4           # held-out chat prompts to decode
MAX_NEW_TOKENS = 96   # new tokens per prompt

# %%
import matplotlib.pyplot as plt
import numpy as np

import specjax
from specjax.notebook import summary

llm = specjax.LLM("smollm2", dtype=ENV.dtype, refiner=None)  # the target with its committed drafter
model, drafter = llm.model, llm.drafter
texts = specjax.HELDOUT_CHAT_PROMPTS[:PROMPTS]
prompts = [llm.encode(t) for t in texts]
print(f"drafter: {drafter.config.num_layers} layer, block {drafter.config.block_size}, "
      f"head over {len(drafter.draft_vocab) if drafter.draft_vocab is not None else 'all'} tokens")

# %% [markdown]
# ## Autoregressive against block-diffusion chains, side by side
# `llm.bench` alternates the methods prompt by prompt, so machine noise hits both alike, and keeps
# compilation out of the timing.

# %%
report = llm.bench(texts, methods=("ar", "chain"), max_tokens=MAX_NEW_TOKENS, progress=False)
print(report)
chain = report["methods"]["chain"]

# %%
acceptance = chain["per_position_acceptance"]
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
left.bar(np.arange(1, len(acceptance) + 1), acceptance, color="tab:green")
left.set(xlabel="draft slot k", ylabel="fraction of verify steps accepting slot k",
         title=f"Per-position acceptance (tau = {chain['tau']:.2f})", ylim=(0, 1))
speeds = [report["methods"][m]["tokens_per_s"] for m in ("ar", "chain")]
right.bar(["autoregressive", "chain"], speeds, color=["tab:gray", "tab:blue"])
right.set(ylabel="tokens / s (median per prompt)",
          title=f"Speed on {ENV.device}: chain = {chain['speedup_vs_ar']:.2f}x AR")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## One verified block
# Greedy speculation drafts from exactly the context AR decoding has, so we can replay it: for
# every position along the longest answer, the drafter proposes the block that follows, and we
# compare it with the tokens the target decoded there. A verify step accepts the drafts up to the
# first disagreement (green), then commits the target's own token (red slot). Below is the block
# with the most accepted drafts.

# %%
outputs = report["methods"]["ar"]["outputs"]
shown_prompt = max(range(len(prompts)), key=lambda i: len(outputs[i]))  # the longest answer has most blocks
answer = outputs[shown_prompt]  # AR's greedy tokens after that prompt
positions = list(range(max(1, len(answer) - 1)))
contexts = [prompts[shown_prompt] + answer[:p] for p in positions]
# Each block is anchored at the token AR committed there. A batched prefill is not the computation
# AR's one-token steps are, so in bf16 its own next token can differ at near-ties; count them.
drafts, prefill_next = llm.draft_blocks(contexts, anchors=[answer[p] for p in positions])  # [P, K], [P]
differ = int(np.sum(prefill_next != np.asarray([answer[p] for p in positions])))
print(f"the replay's prefill predicts AR's token at {len(positions) - differ} of {len(positions)} positions")

def accepted_drafts(p):
    truth = answer[p + 1 : p + 1 + drafts.shape[1]]
    return int(np.cumprod(drafts[p, : len(truth)] == np.asarray(truth, dtype=drafts.dtype)).sum()) if truth else 0

per_block = [accepted_drafts(p) for p in positions]
p = int(np.argmax(per_block))
accepted = per_block[p]
truth = answer[p + 1 : p + 1 + drafts.shape[1]]
shown = len(truth)
fig, ax = plt.subplots(figsize=(min(16, 1.1 * max(shown, 1) + 2), 2.2))
word = lambda t: repr(model.tokenizer.decode([int(t)]))[1:-1]  # noqa: E731
for k in range(shown):
    colour = "tab:green" if k < accepted else "tab:red" if k == accepted else "lightgray"
    ax.add_patch(plt.Rectangle((k, 1), 0.95, 0.9, color=colour, alpha=0.6))
    ax.text(k + 0.47, 1.45, word(drafts[p, k]), ha="center", va="center", fontsize=8)
    ax.text(k + 0.47, 0.45, word(truth[k]), ha="center", va="center", fontsize=8)
ax.set(xlim=(0, max(shown, 1)), ylim=(0, 2), yticks=[0.45, 1.45], yticklabels=["target (greedy)", "draft"],
       xlabel="draft slot k (tokens after the anchor)",
       title=f"Block drafted after {word(answer[p])!r} (answer token {p}): {accepted} of {shown} drafts accepted")
ax.set_xticks(np.arange(shown) + 0.47, [str(k + 1) for k in range(shown)])
plt.tight_layout()
plt.show()
print(f"accepted drafts per block along the answer: {per_block}")
print("prompt:", texts[shown_prompt])
print("answer:", model.tokenizer.decode(answer).strip())

# %%
summary(tau=chain["tau"], speedup_vs_ar=chain["speedup_vs_ar"], identical_to_ar=chain["identical_to_ar"],
        ar_tokens_per_s=report["methods"]["ar"]["tokens_per_s"], chain_tokens_per_s=chain["tokens_per_s"],
        per_position_acceptance=acceptance, best_block_accepted=accepted)
