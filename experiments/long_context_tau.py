"""Teacher-forced acceptance at long context: windowed against full drafter attention, many anchors.

Decoding 64 tokens per document gives about 50 verify steps per context, too few for a tau to
within a few percent. This script runs the target once over the first 8192 tokens of each held-out
document (from its first third on, as long_context_eval.py does). For each context n it drafts
blocks at --anchors positions spread over [n - 512, n), with the full and with the windowed
drafter, each seeing exactly what it would see while decoding at that length (the decode state
equals this training view, tests/test_windowed_drafter.py). Per anchor it counts 1 + the leading
drafts equal to the target's own greedy tokens: the tokens a greedy chain step would commit there.

    python experiments/long_context_tau.py --json runs/long_context_tau.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--anchors", type=int, default=128, help="anchors per document and context")
    parser.add_argument("--documents", default="Persuasion,Moby Dick,Hamlet")
    parser.add_argument("--compressor", default="default")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm.auto import tqdm

    from specjax.data.corpora import load_split
    from specjax.io.compressor import windowed_drafter
    from specjax.io.registry import load_model, resolve_compressor, resolve_drafter
    from specjax.models.cache import KVCache
    from specjax.models.transformer import apply_head, forward, head_matrix
    from specjax.train.drafter import drafter_block_states

    model = load_model("smollm2")
    drafter = resolve_drafter("default", "smollm2")
    windowed = windowed_drafter(drafter, resolve_compressor(args.compressor, "smollm2"))
    contexts = [int(c) for c in args.contexts.split(",")]
    length = max(contexts)
    titles = [t.strip() for t in args.documents.split(",")]
    _, heldout = load_split(("austen", "gutenberg_novels", "shakespeare"))
    documents = {d.title: d for d in heldout}
    draft_vocab = None if drafter.draft_vocab is None else jnp.asarray(drafter.draft_vocab)
    head = head_matrix(model.params, model.config, draft_vocab)
    block = drafter.config.block_size
    taps = drafter.config.target_layer_ids

    @jax.jit
    def target_pass(tokens):  # [1, L] -> tap features [1, L, taps, d], greedy next tokens [1, L]
        cache = KVCache.zeros(model.config, 1, length)
        out = forward(model.params, model.config, tokens, jnp.arange(length, dtype=jnp.int32)[None], cache,
                      jnp.zeros((1,), jnp.int32), hidden_layers=taps)
        return out.hidden, jnp.argmax(out.logits, axis=-1).astype(jnp.int32)

    def accepted(config, params, tokens, features, greedy, anchors):
        states = drafter_block_states(params, config, model.params, model.config, tokens, features, anchors)
        drafts = jnp.argmax(apply_head(states, head), axis=-1)  # [1, A, K] draft-vocabulary indices
        if draft_vocab is not None:
            drafts = jnp.take(draft_vocab, drafts)
        # The target's greedy token after position a + k - 1 is what slot k must match.
        labels = jnp.take_along_axis(greedy, (anchors[:, :, None] + jnp.arange(block - 1)).reshape(1, -1),
                                     axis=1).reshape(drafts.shape)
        return 1 + jnp.sum(jnp.cumprod((drafts == labels).astype(jnp.int32), axis=-1), axis=-1)  # [1, A]

    evaluate = jax.jit(accepted, static_argnums=0)
    results = {n: {"full": [], "windowed": []} for n in contexts}
    rng = np.random.default_rng(0)
    for title in tqdm(titles, desc="documents"):
        text = documents[title].text
        ids = model.tokenizer.encode(text[len(text) // 3:], add_special_tokens=False)[:length]
        if len(ids) < length:
            raise SystemExit(f"{title} is shorter than {length} tokens after its first third")
        tokens = jnp.asarray([ids], jnp.int32)
        features, greedy = target_pass(tokens)
        for n in contexts:
            # Anchors leave room for a whole block of labels below n.
            anchors = np.sort(rng.choice(np.arange(n - 512, n - block), size=args.anchors, replace=False))
            anchors = jnp.asarray(anchors[None], jnp.int32)
            for name, d in (("full", drafter), ("windowed", windowed)):
                results[n][name].extend(np.asarray(evaluate(d.config, d.params, tokens, features, greedy,
                                                            anchors))[0].tolist())
    summary = []
    for n in contexts:
        full, win = np.asarray(results[n]["full"], float), np.asarray(results[n]["windowed"], float)
        # Paired bootstrap of the ratio over anchors, for a 95% interval.
        picks = rng.integers(0, len(full), size=(2000, len(full)))
        ratios = win[picks].mean(1) / full[picks].mean(1)
        summary.append({"context": n, "anchors": len(full), "tau_full": full.mean(), "tau_windowed": win.mean(),
                        "ratio": win.mean() / full.mean(), "ratio_95": [float(np.percentile(ratios, 2.5)),
                                                                        float(np.percentile(ratios, 97.5))],
                        "same_acceptance_share": float(np.mean(full == win))})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"window": vars(windowed.config.window), "documents": titles,
                                           "summary": summary}, indent=1))
    w = windowed.config.window
    print(f"\nteacher-forced greedy acceptance; windowed: window {w.window}, segment {w.segment}, "
          f"{w.summaries} summaries; {args.anchors} anchors per document in [n-512, n), {len(titles)} documents\n")
    print("| context | anchors | tau full | tau windowed | windowed / full (95% bootstrap) | anchors with equal acceptance |")
    print("|---|---|---|---|---|---|")
    for e in summary:
        print(f"| {e['context']} | {e['anchors']} | {e['tau_full']:.3f} | {e['tau_windowed']:.3f} | {e['ratio']:.3f} "
              f"({e['ratio_95'][0]:.3f}–{e['ratio_95'][1]:.3f}) | {e['same_acceptance_share']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
