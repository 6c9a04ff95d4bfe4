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
# # Causal refinement of block drafts, in miniature
#
# A block-diffusion drafter fills all its slots at once, so slot *k* never sees which token slot
# *k - 1* chose: two slots can each be plausible and still disagree with each other. An
# xPress-style **causal refiner** is a small recurrent head that reads the drafter's states left to
# right, conditioned on the drafts to its left, and rewrites the block before the target checks it.
# Verification is unchanged, so greedy output is still the target's own.
#
# This notebook decodes SmolLM2-135M with its committed drafter, with and without its committed
# GRU refiner, and compares the **acceptance curves**: the fraction of verify steps in which draft
# slot *k* is accepted.

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
PROMPTS = 6                  # held-out chat prompts to decode
MAX_NEW_TOKENS = 96          # new tokens per prompt
REFINE_PASSES = (1, 2)       # refinement passes per block to compare (each compiles once)

# %%
import matplotlib.pyplot as plt
import numpy as np

import specjax
from specjax.notebook import summary

llm = specjax.LLM("smollm2", dtype=ENV.dtype)  # the committed drafter and its refiner come with it
prompts = list(specjax.HELDOUT_CHAT_PROMPTS[:PROMPTS])
print(f"refiner: {llm.refiner.config.kind}, paired with the drafter it was trained for")

# %% [markdown]
# ## Chains with and without the refiner, side by side
# Every variant decodes the same prompts in turn (prompt by prompt, so machine noise hits them
# alike); `identical` compares each output with greedy autoregressive decoding.

# %%
variants = {"ar": "ar", "chain": "chain"}
variants |= {f"refined x{n}": ("chain+refiner", {"refine": specjax.RefineConfig(max_passes=n)})
             for n in REFINE_PASSES}
report = llm.bench(prompts, variants, MAX_NEW_TOKENS, progress=False)
print(report)
for label, entry in report["methods"].items():
    if label != "ar":
        print(f"{label:>12}: identical to AR: {entry['identical_to_ar']}"
              + (f", {entry['refine_passes']:.2f} refinement passes per block" if "refine_passes" in entry else ""))

# %%
fig, (curves, speed) = plt.subplots(1, 2, figsize=(12, 3.8))
for label, entry in report["methods"].items():
    if label == "ar":
        continue
    acc = entry["per_position_acceptance"]
    curves.plot(np.arange(1, len(acc) + 1), acc, marker="o", label=f"{label} (tau {entry['tau']:.2f})")
curves.set(xlabel="draft slot k", ylabel="fraction of verify steps accepting slot k",
           title="Acceptance curves", ylim=(0, 1))
curves.legend()
labels = list(report["methods"])
speed.bar(labels, [report["methods"][m]["tokens_per_s"] for m in labels],
          color=["tab:gray"] + ["tab:blue"] * (len(labels) - 1))
speed.set(ylabel="tokens / s (median per prompt)", title=f"Speed on {ENV.device}")
plt.tight_layout()
plt.show()

# %% [markdown]
# Where does the time go? The draft, refine and verify phases are timed alone and scaled by the steps
# run; these are their shares of a step.

# %%
for label, entry in report["methods"].items():
    if label != "ar":
        print(f"{label:>12}: draft {entry['draft_fraction']:.0%}, refine {entry['refine_fraction']:.0%}, "
              f"verify {entry['verify_fraction']:.0%}; {entry['speedup_vs_ar']:.2f}x AR")

# %%
chain, refined = report["methods"]["chain"], report["methods"][f"refined x{REFINE_PASSES[0]}"]
summary(chain_tau=chain["tau"], refined_tau=refined["tau"], chain_identical_to_ar=chain["identical_to_ar"],
        refined_identical_to_ar=all(e["identical_to_ar"] for m, e in report["methods"].items() if m != "ar"),
        chain_acceptance=chain["per_position_acceptance"], refined_acceptance=refined["per_position_acceptance"],
        refine_passes=refined["refine_passes"], refined_speedup_vs_ar=refined["speedup_vs_ar"])
