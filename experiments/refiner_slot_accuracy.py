"""Teacher-forced per-slot accuracy of the SmolLM2 drafter, with and without a refiner, on each
distillation set of a refiner run (held-out chat and the training sets).

Slot k counts as right when the argmax equals the target's token there, given the true tokens to
its left: exactly the drafts that greedy verification would accept once slots < k were accepted.
Anchors are drawn as in training, with a fixed seed.

    python experiments/refiner_slot_accuracy.py --data runs/refiner-gru/data \\
        --refiner runs/refiner-gru/refiner --batches 4
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a run's data/ folder (distillation sets)")
    parser.add_argument("--refiner", required=True, help="refiner folder")
    parser.add_argument("--batches", type=int, default=4, help="batches of 4 sequences x 32 anchors per set")
    parser.add_argument("--slots", type=int, default=4, help="how many slots to print")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.io.refiner import check_refiner, load_refiner
    from specjax.io.registry import load_model, resolve_drafter
    from specjax.models.refiner import refiner_low_rank_head
    from specjax.models.transformer import head_matrix
    from specjax.train.drafter import DistillationSet, _draft_labels, label_index_for
    from specjax.train.refiner import RefinerTrainConfig, _drafter_pass, _left_tokens, _refined_logits, refiner_batch

    model = load_model("smollm2")
    drafter = resolve_drafter("default", "smollm2")
    refiner = load_refiner(args.refiner)
    check_refiner(refiner, drafter)
    block = drafter.config.block_size
    draft_vocab = None if drafter.draft_vocab is None else jnp.asarray(drafter.draft_vocab)
    label_index = label_index_for(draft_vocab, model.config.vocab_size)
    drafter_params = jax.tree.map(jnp.asarray, drafter.params)
    refiner_params = jax.tree.map(jnp.asarray, refiner.params)

    @jax.jit
    def hits(batch):
        head = head_matrix(model.params, model.config, draft_vocab)
        hidden, logits = _drafter_pass(batch, drafter_params, drafter.config, model.params, model.config, head)
        low_rank = refiner_low_rank_head(refiner_params, refiner.config, head)
        refined = _refined_logits(refiner_params, refiner.config, model.params, model.config, hidden, logits,
                                  _left_tokens(batch, block - 1), low_rank)
        labels, valid = _draft_labels(batch, block, label_index)
        count = lambda lg: ((jnp.argmax(lg, -1) == labels) & valid).sum((0, 1))
        return count(logits), count(refined), valid.sum((0, 1))

    no_mixing = RefinerTrainConfig(drafted_input_rate=0.0)
    print(f"| set | labelled tokens | drafter slots 1..{args.slots} | refined slots 1..{args.slots} |")
    print("|---|---|---|---|")
    for folder in sorted(p for p in Path(args.data).iterdir() if (p / "meta.json").exists()):
        data = DistillationSet.open(folder)
        totals = np.zeros((3, block - 1))
        for i in range(args.batches):
            batch = jax.tree.map(jnp.asarray, refiner_batch(data, i, 999, no_mixing, block))
            totals += np.stack([np.asarray(x) for x in hits(batch)])
        drafted, refined = (totals[j, : args.slots] / np.maximum(totals[2, : args.slots], 1) for j in (0, 1))
        show = lambda a: " / ".join(f"{x:.3f}" for x in a)
        print(f"| {folder.name} | {data.num_tokens:,} | {show(drafted)} | {show(refined)} |")


if __name__ == "__main__":
    main()
