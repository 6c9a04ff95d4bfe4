"""Where does a drafter's block look? Issue 14, cause 2: why the committed drafter's slot-1 logits
ignore the anchor token.

For blocks anchored at the end of held-out chat prompts, this reports, per drafter layer and head,
the attention mass the block's first draft slots put on
  - the anchor slot (slot 0: the only place the anchor token enters a drafter without an anchor path),
  - the first context position (the target's attention sink),
  - the rest of the context, and the other mask slots;
It does this for the committed drafter and for a fresh drafter initialised from the target's top
layer (the recipe's starting point), so that one can see whether training starved the path or the
start already did.

    python experiments/anchor_attention.py [--drafter default|FOLDER] [--prompts 6]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def attention_report(model, loaded, prompts: list[str], slots: int = 4):
    from specjax.decode.autoregressive import prefill
    from specjax.models.drafter import Drafter
    from specjax.models.layers import rope_tables
    from specjax.models.transformer import embed_tokens

    config, params = loaded.config, loaded.params
    block = config.block_size
    drafter = Drafter(config).bind({"params": params})
    rows = []
    for prompt in prompts:
        ids = model.tokenizer.encode_chat(prompt)
        tokens = jnp.asarray([ids], jnp.int32)
        _, _, features = prefill(model.params, model.config, tokens, jnp.asarray([len(ids)], jnp.int32), 256,
                                 hidden_layers=config.target_layer_ids)  # [1, P, taps, d]
        # Anchor = the prompt's last token; context = every position before it.
        anchor_at = len(ids) - 1
        context = features[:, :anchor_at]
        ctx_positions = jnp.arange(anchor_at, dtype=jnp.int32)[None]
        states = drafter.context_states(context)
        h_ctx = drafter.hidden_norm(states)
        block_tokens = jnp.asarray([[ids[-1]] + [config.mask_token_id or 0] * (block - 1)], jnp.int32)
        is_mask = jnp.arange(block)[None] > 0
        x = drafter.block_inputs(embed_tokens(model.params, model.config, block_tokens), is_mask)
        positions = anchor_at + jnp.arange(block, dtype=jnp.int32)[None]
        cos, sin = rope_tables(config.layer_config, positions)
        cos_c, sin_c = rope_tables(config.layer_config, ctx_positions)
        for index, layer in enumerate(drafter.layers):
            k_ctx, v_ctx = layer.keys_values(h_ctx, cos_c, sin_c)
            q, k, v = layer.block_qkv(x, cos, sin)
            keys = jnp.concatenate([k_ctx, k], axis=1)  # [1, S+Q, K, D]
            group = config.num_heads // config.num_kv_heads
            keys_h = jnp.repeat(keys, group, axis=2)
            logits = jnp.einsum("bqhd,bshd->bhqs", q.astype(jnp.float32), keys_h.astype(jnp.float32))
            probs = jax.nn.softmax(logits / np.sqrt(config.head_dim), axis=-1)[0]  # [H, Q, S+Q]
            for s in range(1, slots + 1):
                p = np.asarray(probs[:, s])  # [H, S+Q]
                rows.append({
                    "layer": index, "slot": s,
                    "anchor": p[:, anchor_at], "sink": p[:, 0], "context": p[:, 1:anchor_at].sum(-1),
                    "masks": p[:, anchor_at + 1 :].sum(-1),
                })
            out = layer(x, cos, sin, k_ctx, v_ctx, jnp.ones((1, block, anchor_at + block), bool))
            x = out
    return rows


def summarise(rows, label: str):
    print(f"\n== {label}")
    layers = sorted({r["layer"] for r in rows})
    for layer in layers:
        print(f"layer {layer}: attention mass of draft slots (mean over prompts; max head in brackets)")
        print("  slot | anchor slot      | context[0] (sink) | rest of context | other mask slots")
        for s in sorted({r["slot"] for r in rows if r["layer"] == layer}):
            sel = [r for r in rows if r["layer"] == layer and r["slot"] == s]
            cell = lambda key, sel=sel: f"{np.mean([r[key].mean() for r in sel]):.4f} ({np.mean([r[key].max() for r in sel]):.4f})"  # noqa: E501
            print(f"  {s:>4} | {cell('anchor'):16} | {cell('sink'):17} | {cell('context'):15} | {cell('masks')}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args()

    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.io.registry import load_model, resolve_drafter
    from specjax.models.drafter import init_drafter_params
    from specjax.train.drafter import init_from_target_layers

    model = load_model("smollm2")
    loaded = resolve_drafter(args.drafter, "smollm2")
    prompts = list(HELDOUT_CHAT_PROMPTS)[: args.prompts]
    summarise(attention_report(model, loaded, prompts), f"trained drafter ({loaded.source})")
    fresh = init_drafter_params(loaded.config, jax.random.key(0))
    top = list(range(model.config.num_layers - loaded.config.num_layers, model.config.num_layers))
    start = init_from_target_layers(fresh, model.params, top)
    summarise(attention_report(model, type(loaded)(loaded.source, loaded.config, start, loaded.num_target_layers,
                                                   loaded.draft_vocab), prompts),
              f"untrained start: target layer(s) {top} copied in")


if __name__ == "__main__":
    main()
