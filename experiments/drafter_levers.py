"""Drafter levers side by side (issue 14, item 6): the committed drafter trained on in several
variants, on the same data, for the same steps, each scored the same way.

    python experiments/drafter_levers.py --data runs/drafter-v3/data [--data MORE ...] --steps 1000 \
        [--variants b8,b16] [--out runs/levers] [--learning-rate 5e-4] [--start FOLDER] [--evals 5]

A variant is a dash-joined list of settings:
  b<N>      block size N (the committed drafter's slot embeddings are cut or kept; default 16);
  l<N>      N layers: the committed drafter grown by zero-output layers copied from the target's top
            layers (`train/drafter.py:init_from_drafter`; default: the committed depth);
  topk<W>   a share W of the loss against the target's stored top-k distribution instead of its
            argmax token (`DrafterTrainConfig.topk_weight`; the sets must be built with top-k);
  d<N>      train on the first N `--data` folders only (default: all of them), the data lever;
  g<X>      slot k's loss weight exp(-(k-1)/X) (`DrafterTrainConfig.gamma`, default 7): a small X
            spends the drafter's capacity on the first slots, which carry most of a chain's tau;
  a<N>      N anchor blocks per sequence per step (default 32; DFlash uses 512);
  v<N>      a head over the N most frequent labels of the training sets; v0 is the target's whole
            vocabulary through its own head, as DFlash drafts (default: the starting drafter's).
For example `--variants b8,b8-topk1,b8-l2` compares argmax cross-entropy, top-k cross-entropy and a
second layer at block 8.

Each run starts from the committed drafter (or `--start FOLDER`), trains in `--dtype` (bf16 by default,
with float32 master weights) on the distillation sets in each `--data` folder (those `specjax
train-drafter` wrote: chat, everyday, math, code, self_instruct, corpus, sharegpt and sharegpt_replies,
whichever exist), and is scored by greedy chain decoding replayed over the held-out answers in the
first folder's `--heldout` set (heldout_chat by default), looping ones left out (`chain_walk_tau`). Every run on the same data sees the same batches of sequences and anchors. Each drafter is written to `--out/<variant>/drafter`,
for real decoding with experiments/drafter_compare.py. A rerun resumes each run from its checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

TRAIN_SETS = ("chat", "everyday", "math", "code", "self_instruct", "corpus", "sharegpt", "sharegpt_replies")
SETTING = re.compile(r"^(b|l|d|g|a|v|topk)(\d+(?:\.\d+)?)$")


def parse_variant(text: str, committed_layers: int, data_folders: int, default_gamma: float) -> dict:
    """'b8-topk1' -> {'block': 8, 'layers': committed_layers, 'topk_weight': 1.0, 'data': data_folders,
    'gamma': default_gamma, 'anchors': 32, 'vocab': None}; vocab None keeps the starting drafter's head."""
    variant = {"block": 16, "layers": committed_layers, "topk_weight": 0.0, "data": data_folders,
               "gamma": default_gamma, "anchors": 32, "vocab": None}
    for part in text.split("-"):
        match = SETTING.match(part)
        if match is None:
            raise SystemExit(f"variant {text!r}: {part!r} is none of b<N>, l<N>, d<N>, g<X>, a<N>, v<N>, topk<W>")
        key, value = match.groups()
        if key in ("topk", "g"):
            variant[{"topk": "topk_weight", "g": "gamma"}[key]] = float(value)
        else:
            variant[{"b": "block", "l": "layers", "d": "data", "a": "anchors", "v": "vocab"}[key]] = int(value)
    if not 1 <= variant["data"] <= data_folders:
        raise SystemExit(f"variant {text!r}: d{variant['data']} asks for more than the {data_folders} --data folders")
    return variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, action="append",
                        help="a train-drafter run's data folder (repeatable; the first one's held-out set scores)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--variants", default="b8,b16")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--evals", type=int, default=5,
                        help="held-out evaluations (and checkpoints) over the run, evenly spaced; more draw a finer curve")
    parser.add_argument("--out", default="runs/levers")
    parser.add_argument("--heldout", default="heldout_chat",
                        help="the first --data folder's held-out set that scores every run (heldout_sharegpt for ShareGPT)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype of target and drafter (float32 where the CPU has no bf16 units)")
    parser.add_argument("--plot", help="also draw the held-out curves (chain tau against step) into this PNG")
    parser.add_argument("--start", default="default",
                        help="the drafter every variant starts from: a DFlash-format folder, or default (the committed one)")
    args = parser.parse_args()
    if args.evals < 1 or args.steps < 1:
        parser.error("--steps and --evals must be at least 1")

    import jax
    import numpy as np

    from specjax.io.dflash import save_drafter
    from specjax.io.registry import load_model, resolve_drafter
    from specjax.models.drafter import DrafterConfig, init_drafter_params
    from specjax.train.drafter import (DistillationSet, DrafterTrainConfig, choose_draft_vocab, heldout_chain_tau,
                                       init_from_drafter, init_from_target_layers, train_drafter, without_looping)
    from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics

    folders = [Path(d) for d in args.data]
    sets_by_folder = []
    for data in folders:
        found = [DistillationSet.open(data / name) for name in TRAIN_SETS if (data / name / "meta.json").exists()]
        if not found:
            parser.error(f"{data} holds none of the distillation sets {', '.join(TRAIN_SETS)}")
        sets_by_folder.append(found)
        print(f"{data}: {sum(s.num_tokens for s in found):,} labels", flush=True)
    heldout, looping = without_looping(DistillationSet.open(folders[0] / args.heldout))
    print(f"{args.heldout}: {heldout.num_sequences} answers ({looping} looping left out)", flush=True)
    model = load_model("smollm2", args.dtype)
    committed = resolve_drafter(args.start, "smollm2")
    variants = {name: parse_variant(name, committed.config.num_layers, len(folders), DrafterTrainConfig.gamma)
                for name in args.variants.split(",")}
    results = {}
    for name, variant in variants.items():
        block, layers = variant["block"], variant["layers"]
        sets = [s for found in sets_by_folder[: variant["data"]] for s in found]
        config = DrafterConfig.for_target(model.config, num_layers=layers, block_size=block,
                                          num_taps=len(committed.config.target_layer_ids),
                                          anchor_path=committed.config.anchor_path)
        if variant["vocab"] is None:
            draft_vocab = committed.draft_vocab
        elif variant["vocab"] == 0 or variant["vocab"] >= model.config.vocab_size:
            draft_vocab = None
        else:
            draft_vocab = choose_draft_vocab(sets, variant["vocab"], always=model.eos_token_ids)
        # The committed drafter's slots 0..block-1 carry over; every other parameter is block-free.
        cut = jax.tree_util.tree_map_with_path(
            lambda path, a: a[:block] if "slot_embedding" in jax.tree_util.keystr(path) else a, committed.params)
        start = dataclasses.replace(committed, config=dataclasses.replace(committed.config, block_size=block),
                                    params=cut)
        fresh = init_from_target_layers(init_drafter_params(config, jax.random.key(0)), model.params,
                                        range(model.config.num_layers - layers, model.config.num_layers))
        params = init_from_drafter(fresh, config, start)
        run = Path(args.out) / name
        before = heldout_chain_tau(heldout, config, model.params, model.config, draft_vocab)(params)
        params = train_drafter(
            model.params, model.config, config, sets, run / "run",
            OptimizerConfig(learning_rate=args.learning_rate, warmup_steps=min(200, args.steps // 10),
                            total_steps=args.steps),
            LoopConfig(steps=args.steps, seed=0, eval_every=max(args.steps // args.evals, 1),
                       checkpoint_every=max(args.steps // args.evals, 1)),
            DrafterTrainConfig(sequences_per_batch=4, anchors_per_sequence=variant["anchors"],
                               topk_weight=variant["topk_weight"], gamma=variant["gamma"]),
            heldout=heldout, init_params=params, draft_vocab=draft_vocab)
        save_drafter(run / "drafter", config, params, model.config, dtype="bfloat16",
                     draft_vocab=None if draft_vocab is None else np.asarray(draft_vocab))
        metrics = read_metrics(run / "run")
        evals = [m for m in metrics if "eval/tau_estimate" in m]
        elapsed = [m["elapsed_s"] for m in metrics if "elapsed_s" in m]  # since this process's start
        results[name] = {"variant": variant, "wall_s": elapsed[-1] if elapsed else None,
                         "train_labels": sum(s.num_tokens for s in sets),
                         "curve": [{"step": 0, "chain_walk_tau": before}] + [
                             {"step": m["step"], "chain_walk_tau": m["eval/tau_estimate"]} for m in evals]}
        print(f"{name}: " + ", ".join(f"step {e['step']} tau {e['chain_walk_tau']:.3f}"
                                      for e in results[name]["curve"]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=1))
    print("\n| step | " + " | ".join(f"{name}: held-out chain tau" for name in results) + " |")
    print("|---|" + "---|" * len(results))
    curves = [r["curve"] for r in results.values()]
    for i, entry in enumerate(curves[0]):
        print(f"| {entry['step']} | " + " | ".join(f"{c[i]['chain_walk_tau']:.3f}" if i < len(c) else "-"
                                                  for c in curves) + " |")
    print("| training wall s (evaluations included; a resumed run counts its last process) | "
          + " | ".join(f"{r['wall_s']:.0f}" if r["wall_s"] else "-" for r in results.values()) + " |")
    if args.plot:
        plot_curves(results, args.plot, heldout.num_sequences)


def plot_curves(results: dict, path: str, answers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, result in results.items():
        curve = result["curve"]
        ax.plot([e["step"] for e in curve], [e["chain_walk_tau"] for e in curve], marker="o",
                label=f"{name} ({result['train_labels'] / 1e3:,.0f}k training labels)")
    ax.set_xlabel("training step (4 sequences x 32 anchors each)")
    per_step = 4 * 32 / 1e3  # anchor blocks a step, in thousands: the "tokens seen" axis
    top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda k: k / per_step))
    top.set_xlabel("anchor blocks seen (thousands)")
    ax.set_ylabel("held-out chain tau (greedy chain decoding replayed)")
    ax.set_title(f"drafter levers, scored on {answers} held-out chat answers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
