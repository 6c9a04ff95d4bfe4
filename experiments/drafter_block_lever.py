"""The block-size lever (issue 14, item 6): the committed drafter trained on, side by side, with
blocks of each `--blocks` size, on the same data for the same steps.

    python experiments/drafter_block_lever.py --data runs/drafter-v3/data --steps 1000 \
        [--blocks 8,16] [--out runs/lever-block] [--learning-rate 5e-4]

Each run starts from the committed drafter (its slot embeddings cut to the block), trains in bf16
with float32 master weights on the distillation sets in `--data` (those `specjax train-drafter`
wrote: chat, everyday, math, code, self_instruct and corpus, whichever exist), and is scored by
greedy chain decoding replayed over the held-out chat answers in `--data/heldout_chat`, looping
ones left out (`train/drafter.py:chain_walk_tau`). Both runs see the same batches of sequences
and anchors; a block of 8 trains 7 draft slots per anchor where 16 trains 15. The drafter of each
run is written to `--out/b<block>/drafter`, for real decoding with experiments/drafter_compare.py.
A rerun resumes each run from its checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

TRAIN_SETS = ("chat", "everyday", "math", "code", "self_instruct", "corpus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a train-drafter run's data folder")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--blocks", default="8,16")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--out", default="runs/lever-block")
    args = parser.parse_args()

    import jax
    import numpy as np

    from specjax.io.dflash import save_drafter
    from specjax.io.registry import load_model, resolve_drafter
    from specjax.models.drafter import DrafterConfig, init_drafter_params
    from specjax.train.drafter import (DistillationSet, DrafterTrainConfig, heldout_chain_tau, init_from_drafter,
                                       train_drafter, without_looping)
    from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics

    data = Path(args.data)
    sets = [DistillationSet.open(data / name) for name in TRAIN_SETS if (data / name / "meta.json").exists()]
    if not sets:
        parser.error(f"{data} holds none of the distillation sets {', '.join(TRAIN_SETS)}")
    heldout, looping = without_looping(DistillationSet.open(data / "heldout_chat"))
    print(f"training sets: {sum(s.num_tokens for s in sets):,} labels; held-out chat: {heldout.num_sequences} "
          f"answers ({looping} looping left out)", flush=True)
    model = load_model("smollm2", "bfloat16")
    committed = resolve_drafter("default", "smollm2")
    results = {}
    for block in (int(b) for b in args.blocks.split(",")):
        config = DrafterConfig.for_target(model.config, num_layers=committed.config.num_layers, block_size=block,
                                          num_taps=len(committed.config.target_layer_ids),
                                          anchor_path=committed.config.anchor_path)
        # The committed drafter's slots 0..block-1 carry over; every other parameter is block-free.
        cut = jax.tree_util.tree_map_with_path(
            lambda path, a: a[:block] if "slot_embedding" in jax.tree_util.keystr(path) else a, committed.params)
        start = dataclasses.replace(committed, config=dataclasses.replace(committed.config, block_size=block),
                                    params=cut)
        params = init_from_drafter(init_drafter_params(config, jax.random.key(0)), config, start)
        run = Path(args.out) / f"b{block}"
        before = heldout_chain_tau(heldout, config, model.params, model.config, committed.draft_vocab)(params)
        params = train_drafter(
            model.params, model.config, config, sets, run / "run",
            OptimizerConfig(learning_rate=args.learning_rate, warmup_steps=min(200, args.steps // 10),
                            total_steps=args.steps),
            LoopConfig(steps=args.steps, seed=0, eval_every=max(args.steps // 5, 1),
                       checkpoint_every=max(args.steps // 5, 1)),
            DrafterTrainConfig(sequences_per_batch=4, anchors_per_sequence=32),
            heldout=heldout, init_params=params, draft_vocab=committed.draft_vocab)
        save_drafter(run / "drafter", config, params, model.config, dtype="bfloat16",
                     draft_vocab=None if committed.draft_vocab is None else np.asarray(committed.draft_vocab))
        evals = [m for m in read_metrics(run / "run") if "eval/tau_estimate" in m]
        results[block] = [{"step": 0, "chain_walk_tau": before, "per_anchor_tau": None}] + [
            {"step": m["step"], "chain_walk_tau": m["eval/tau_estimate"], "per_anchor_tau": m.get("eval/tau_per_anchor")}
            for m in evals]
        print(f"block {block}: " + ", ".join(f"step {e['step']} tau {e['chain_walk_tau']:.3f}" for e in results[block]),
              flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=1))
    print("\n| step | " + " | ".join(f"block {b}: held-out chain tau" for b in results) + " |")
    print("|---|" + "---|" * len(results))
    for i, entry in enumerate(next(iter(results.values()))):
        print(f"| {entry['step']} | " + " | ".join(f"{r[i]['chain_walk_tau']:.3f}" if i < len(r) else "-"
                                                  for r in results.values()) + " |")


if __name__ == "__main__":
    main()
