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
# # Budget-aware draft trees, in miniature
#
# A draft tree verifies several candidate continuations in one target pass: the drafter's best
# chain plus branches where it was unsure. More nodes accept more tokens per pass, but each node
# makes the pass dearer, and how much dearer depends on the hardware. A Bastion-style **budget
# rule** grows the tree best-first (by the drafter's path probability) and stops adding nodes when
# the next one's expected gain no longer pays for its measured cost.
#
# This notebook shows, for SmolLM2-135M and its committed drafter on this machine:
# 1. the **verify-cost curve**: the time of one target pass against the nodes it checks;
# 2. the tree sizes the rule **picks**: how many verify steps ran at each size;
# 3. **tau against tree size** for fixed-size trees, and what each size buys in tokens/s.

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
PROMPTS = 4                       # held-out chat prompts to decode
MAX_NEW_TOKENS = 96               # new tokens per prompt
FIXED_SIZES = (2, 4, 8, 16)       # tree sizes (nodes, root included) to compare; each compiles once
AUTO_BUCKETS = None               # sizes the budget rule may pick from; None: the backend's default

# %%
import matplotlib.pyplot as plt
import numpy as np

import specjax
from specjax.notebook import summary

# latency_cache=False: measure the verify costs afresh, in this process
llm = specjax.LLM("smollm2", dtype=ENV.dtype, latency_cache=False)
prompts = list(specjax.HELDOUT_CHAT_PROMPTS[:PROMPTS])

# %% [markdown]
# ## Trees sized by the budget rule against fixed sizes, side by side
# The auto tree measures the verify-cost curve on first use (here in this process; the CLI caches it
# on disk per machine, model and shape) and refits it online from each decode call's wall time.

# %%
auto_tree = specjax.TreeConfig() if AUTO_BUCKETS is None else specjax.TreeConfig(buckets=tuple(AUTO_BUCKETS))
variants = {"ar": "ar", "tree (auto)": ("tree", {"tree": auto_tree})}
variants |= {f"tree {n}": ("tree", {"tree": specjax.TreeConfig(budget=n)}) for n in FIXED_SIZES}
report = llm.bench(prompts, variants, MAX_NEW_TOKENS, progress=False)
print(report)
auto = report["methods"]["tree (auto)"]
print("identical to AR:", {m: e["identical_to_ar"] for m, e in report["methods"].items() if m != "ar"})

# %%
(latency,) = llm.latency_models.values()  # the auto tree's model: measured, then refitted
sizes = np.asarray(latency.sizes)
verify_ms, refitted_ms = 1e3 * np.asarray(latency.prior_verify_s), 1e3 * np.asarray(latency.verify_s)
picked = {int(k): v for k, v in auto["tree_bucket_counts"].items()}
fixed = [report["methods"][f"tree {n}"] for n in FIXED_SIZES]

fig, (cost, chosen, taus) = plt.subplots(1, 3, figsize=(15, 3.8))
cost.plot(sizes, verify_ms, marker="o", label="verify pass, measured")
cost.plot(sizes, refitted_ms, marker=".", linestyle=":", label="verify pass, refitted from decode calls")
cost.axhline(1e3 * latency.prior_fixed_s, color="tab:gray", linestyle="--", label="drafting + tree building")
cost.set_xscale("log", base=2)
cost.minorticks_off()
cost.set(xticks=sizes, xticklabels=[str(s) for s in sizes], xlabel="nodes verified (log scale)",
         ylabel="ms per step part", title="Verify-cost curve")
cost.legend()
chosen.bar([str(s) for s in sorted(picked)], [picked[s] for s in sorted(picked)], color="tab:purple")
chosen.set(xlabel="tree size verified (nodes)", ylabel="verify steps",
           title=f"Sizes the budget rule picked (mean {auto['tree_nodes_chosen']:.1f} nodes)")
taus.plot(FIXED_SIZES, [e["tau"] for e in fixed], marker="o", label="tau (tokens per target pass)")
taus.set_xscale("log", base=2)
taus.minorticks_off()
taus.set(xticks=FIXED_SIZES, xticklabels=[str(n) for n in FIXED_SIZES],
         xlabel="fixed tree size (nodes, log scale)", ylabel="tau", title="tau and speed against tree size")
speed = taus.twinx()
speed.plot(FIXED_SIZES, [e["speedup_vs_ar"] for e in fixed], marker="s", color="tab:orange", label="speedup vs AR")
speed.axhline(auto["speedup_vs_ar"], color="tab:orange", linestyle=":", label="auto tree's speedup")
speed.set(ylabel="x autoregressive tokens/s")
taus.legend(loc="upper left")
speed.legend(loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# The rule reads only the measured curve: where verifying more nodes costs much more (a CPU), it
# keeps trees small; where a 64-node pass costs about what a 1-node one does, as is typical of a
# GPU, the same rule grows them. Rerun this notebook on your hardware to see which.

# %%
summary(auto_tau=auto["tau"], auto_speedup_vs_ar=auto["speedup_vs_ar"], auto_nodes_chosen=auto["tree_nodes_chosen"],
        verify_ms=verify_ms.tolist(), verify_sizes=sizes.tolist(), fixed_sizes=list(FIXED_SIZES),
        fixed_tau=[e["tau"] for e in fixed], fixed_speedup_vs_ar=[e["speedup_vs_ar"] for e in fixed],
        identical_to_ar=all(e["identical_to_ar"] for m, e in report["methods"].items() if m != "ar"))
