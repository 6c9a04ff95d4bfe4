"""Candidates per depth and tree budget against tau and tokens/s on SmolLM2 (batch 1, greedy,
12 held-out prompts, one process). Run B of docs/notes/2026-12-03-draft-trees.md:

    python experiments/tree_topk_probe.py
"""
from specjax.io.registry import load_model, resolve_drafter
from specjax.decode.engine import Engine
from specjax.decode.tree import TreeConfig
from specjax.decode.bench import Variant, run_variants
from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
model = load_model("smollm2"); drafter = resolve_drafter("default", "smollm2")
e = Engine(model, drafter)
prompts = [model.tokenizer.encode_chat(t) for t in HELDOUT_CHAT_PROMPTS]
vs = [Variant("chain", e, "chain")]
for k in (8, 16, 32):
    vs.append(Variant(f"b16 k{k}", e, "tree", (("tree", TreeConfig(budget=16, top_k=k)),)))
for k in (8, 32):
    vs.append(Variant(f"auto k{k}", e, "tree", (("tree", TreeConfig(top_k=k)),)))
vs.append(Variant("b32 k32", e, "tree", (("tree", TreeConfig(budget=32, top_k=32)),)))
r = run_variants(vs, prompts, 128, progress=False)
for l, m in r["methods"].items():
    print(l, round(m["tokens_per_s"], 1), round(m["tau"], 3), [round(a, 3) for a in m["per_position_acceptance"][:3]], m.get("tree_nodes_chosen"), m.get("tree_bucket_counts"), flush=True)
