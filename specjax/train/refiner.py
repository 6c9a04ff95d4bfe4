"""Training a causal refiner on top of a frozen drafter.

Each step draws sequences and random anchors from distillation sets (train/drafter.py), runs the
frozen drafter over every anchor's block in one pass, and trains the refiner to predict the
target's token at each draft slot from the drafter's state there and the token to its left:

  - teacher forcing: the token to the left is the sequence's own token, which is exactly what
    greedy verification conditions on (slot k only counts when slots < k were accepted);
  - scheduled sampling: with a probability that ramps up over training, the token to the left is
    the drafter's own draft instead, as in the first refinement pass at decode time.

Loss: cross-entropy against the target's tokens, weighted by exp(-(k-1)/gamma) over slots.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.errors import SpecjaxError, check_at_least, check_compute_dtype, check_positive_finite
from specjax.sharding import MeshConfig, is_writer
from specjax.models.drafter import DrafterConfig
from specjax.models.config import TransformerConfig
from specjax.models.refiner import (RefinerConfig, draft_confidence, drafter_fingerprint, init_refiner_params,
                                    refiner_corrections, refiner_low_rank_head)
from specjax.models.transformer import apply_head, embed_tokens, head_matrix
from specjax.train.drafter import (DistillationSet, DrafterTrainConfig, _draft_labels, check_taps,
                                   drafter_block_states, label_index_for, sample_drafter_batch)


@dataclasses.dataclass(frozen=True)
class RefinerTrainConfig:
    """How refiner batches are drawn, mixed and weighted."""

    sequences_per_batch: int = 4
    """Sequences per step."""
    anchors_per_sequence: int = 32
    """Random blocks per sequence, all drafted in one drafter pass."""
    gamma: float = 7.0
    """Slot k's loss weight is exp(-(k-1)/gamma), as for the drafter."""
    drafted_input_rate: float = 0.3
    """Final probability that a slot's left token is the drafter's draft rather than the true token."""
    ramp_steps: int = 500
    """Steps over which that probability rises linearly from 0."""

    def __post_init__(self):
        if not 0.0 <= self.drafted_input_rate <= 1.0:
            raise SpecjaxError(f"drafted_input_rate must be in [0, 1], got {self.drafted_input_rate}")


def refiner_batch(data, step: int, seed: int, cfg: RefinerTrainConfig, block: int) -> dict:
    """sample_drafter_batch plus this step's scheduled-sampling rate (a pure function of step)."""
    batch = sample_drafter_batch(data, step, seed, DrafterTrainConfig(cfg.sequences_per_batch, cfg.anchors_per_sequence,
                                                                      cfg.gamma), block)
    ramp = min(1.0, step / cfg.ramp_steps) if cfg.ramp_steps else 1.0
    batch["drafted_rate"] = np.float32(cfg.drafted_input_rate * ramp)
    return batch


def _drafter_pass(batch, drafter_params, drafter_config: DrafterConfig, target_params, target_config, head):
    """Frozen drafter over every anchor's block: states [b, A, K, d] and logits [b, A, K, V']."""
    hidden = drafter_block_states(drafter_params, drafter_config, target_params, target_config, batch["tokens"],
                                  batch["features"], batch["anchors"])
    hidden = jax.lax.stop_gradient(hidden)
    logits = apply_head(hidden, head)  # [b, A, K, V']
    return hidden, logits


def _left_tokens(batch, num_draft: int):
    """The sequence's token left of each draft slot: tokens[a + k - 1], k = 1..K -> [b, A, K]."""
    seq_len = batch["tokens"].shape[1]
    pos = jnp.minimum(batch["anchors"][:, :, None] + jnp.arange(num_draft), seq_len - 1)  # [b, A, K]
    flat = jnp.take_along_axis(batch["tokens"], pos.reshape(pos.shape[0], -1), axis=1)
    return flat.reshape(pos.shape)


def _refined_logits(refiner_params, refiner_config, target_params, target_config, hidden, drafter_logits, left, low_rank):
    b, a, k, d = hidden.shape
    previous = embed_tokens(target_params, target_config, left.reshape(b * a, k))  # [b*A, K, d]
    confidence = draft_confidence(drafter_logits).reshape(b * a, k, 2)
    correction = refiner_corrections(refiner_params, refiner_config, hidden.reshape(b * a, k, d), previous, confidence,
                                     low_rank)
    return drafter_logits + correction.reshape(drafter_logits.shape)


def refiner_loss(refiner_params, batch: dict, rng, *, refiner_config: RefinerConfig, drafter_params,
                 drafter_config: DrafterConfig, target_params, target_config: TransformerConfig, gamma: float,
                 draft_vocab=None, label_index=None):
    """Decay-weighted cross-entropy of the refined logits. Returns (loss, metrics)."""
    block = drafter_config.block_size
    num_draft = block - 1
    head = head_matrix(target_params, target_config, draft_vocab)
    hidden, drafter_logits = _drafter_pass(batch, drafter_params, drafter_config, target_params, target_config, head)
    true_left = _left_tokens(batch, num_draft)  # [b, A, K]
    drafted = jnp.argmax(drafter_logits, axis=-1)
    drafted = drafted if draft_vocab is None else jnp.take(draft_vocab, drafted)
    drafted_left = jnp.concatenate([true_left[..., :1], drafted[..., :-1]], axis=-1)  # slot 1's left is the anchor
    use_drafted = jax.random.bernoulli(rng, batch["drafted_rate"], true_left.shape)
    left = jnp.where(use_drafted, drafted_left, true_left)
    low_rank = refiner_low_rank_head(refiner_params, refiner_config, head)
    logits = _refined_logits(refiner_params, refiner_config, target_params, target_config, hidden, drafter_logits,
                             left, low_rank)
    labels, valid = _draft_labels(batch, block, label_index)
    weight = valid * jnp.exp(-(jnp.arange(1, block) - 1) / gamma)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = jnp.sum(ce * weight) / jnp.maximum(jnp.sum(weight), 1e-6)
    hit = (jnp.argmax(logits, -1) == labels) & valid
    drafter_hit = (jnp.argmax(drafter_logits, -1) == labels) & valid
    slot2 = lambda h: jnp.sum(h[..., 1]) / jnp.maximum(jnp.sum(valid[..., 1]), 1)
    return loss, {"slot2_accuracy": slot2(hit), "drafter_slot2_accuracy": slot2(drafter_hit)}


def estimate_refined_tau(refiner_params, refiner_config: RefinerConfig, drafter_params, drafter_config: DrafterConfig,
                         target_params, target_config: TransformerConfig, batch: dict, draft_vocab=None,
                         label_index=None) -> dict:
    """Teacher-forced acceptance-length estimates on a batch, for the drafter alone, after one
    refinement pass, and at the refiner's fixed point (what adaptive refinement converges to).

    At the fixed point slot k is drafted given the drafts to its left, and under greedy acceptance
    it only counts when those equal the true tokens; so the fixed point's accepted length is the
    run of slots whose teacher-forced refined argmax is right.
    """
    block = drafter_config.block_size
    num_draft = block - 1
    head = head_matrix(target_params, target_config, draft_vocab)
    hidden, drafter_logits = _drafter_pass(batch, drafter_params, drafter_config, target_params, target_config, head)
    labels, valid = _draft_labels(batch, block, label_index)
    usable = valid[..., 0]
    to_token = (lambda i: i) if draft_vocab is None else (lambda i: jnp.take(draft_vocab, i))
    low_rank = refiner_low_rank_head(refiner_params, refiner_config, head)
    true_left = _left_tokens(batch, num_draft)

    def tau(logits):
        match = (jnp.argmax(logits, -1) == labels) & valid
        accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)
        return jnp.sum((accepted + 1) * usable) / jnp.maximum(jnp.sum(usable), 1)

    drafted_left = jnp.concatenate([true_left[..., :1], to_token(jnp.argmax(drafter_logits, -1))[..., :-1]], axis=-1)
    one_pass = _refined_logits(refiner_params, refiner_config, target_params, target_config, hidden, drafter_logits,
                               drafted_left, low_rank)
    fixed_point = _refined_logits(refiner_params, refiner_config, target_params, target_config, hidden,
                                  drafter_logits, true_left, low_rank)
    return {"tau_drafter": tau(drafter_logits), "tau_one_pass": tau(one_pass), "tau_fixed_point": tau(fixed_point)}


def train_refiner(target_params, target_config: TransformerConfig, drafter, refiner_config: RefinerConfig,
                  data: DistillationSet | Sequence[DistillationSet], out_dir: str | Path, optimizer=None, loop=None,
                  train_config: RefinerTrainConfig = RefinerTrainConfig(), heldout: DistillationSet | None = None):
    """Train a refiner for `drafter` (a LoadedDrafter, kept frozen). Resumes from out_dir.

    Logs loss, slot-2 accuracy with and without the refiner and (with a held-out set) the
    teacher-forced acceptance-length estimates `eval/tau_drafter`, `eval/tau_one_pass` and
    `eval/tau_fixed_point`. Returns the trained refiner params.
    """
    from specjax.train.loop import LoopConfig, OptimizerConfig, train

    dcfg = drafter.config
    if refiner_config.hidden_size != dcfg.hidden_size or refiner_config.block_size != dcfg.block_size:
        raise SpecjaxError(f"refiner shape (width {refiner_config.hidden_size}, block {refiner_config.block_size}) "
                           f"does not fit the drafter (width {dcfg.hidden_size}, block {dcfg.block_size})")
    check_taps(data, dcfg)
    optimizer = optimizer or OptimizerConfig()
    loop = loop or LoopConfig()
    params = init_refiner_params(refiner_config, jax.random.key(loop.seed))
    draft_vocab = None if drafter.draft_vocab is None else jnp.asarray(drafter.draft_vocab, jnp.int32)
    label_index = label_index_for(draft_vocab, target_config.vocab_size)
    drafter_params = jax.tree.map(jnp.asarray, drafter.params)

    def loss_fn(p, batch, rng):
        return refiner_loss(p, batch, rng, refiner_config=refiner_config, drafter_params=drafter_params,
                            drafter_config=dcfg, target_params=target_params, target_config=target_config,
                            gamma=train_config.gamma, draft_vocab=draft_vocab, label_index=label_index)

    block = dcfg.block_size
    batch_fn = lambda step: jax.tree.map(jnp.asarray, refiner_batch(data, step, loop.seed, train_config, block))
    eval_fn = None
    if heldout is not None:
        eval_batches = [jax.tree.map(jnp.asarray, refiner_batch(heldout, i, 12345, train_config, block))
                        for i in range(4)]
        estimate = jax.jit(lambda p, b: estimate_refined_tau(p, refiner_config, drafter_params, dcfg, target_params,
                                                             target_config, b, draft_vocab, label_index))

        def heldout_estimate(p):
            results = [estimate(p, b) for b in eval_batches]
            return {k: float(np.mean([r[k] for r in results])) for k in results[0]}

        eval_fn = heldout_estimate

    trained, _ = train(loss_fn, params, batch_fn, out_dir, optimizer, loop, eval_fn=eval_fn)
    return trained


@dataclasses.dataclass(frozen=True)
class RefinerRecipe:
    """`specjax train-refiner`: which refiner, on which data, for how long."""

    kind: str = "transformer"
    """Mixer: "transformer" or "gru"."""
    width: int = 128
    """Mixer width."""
    rank: int = 64
    """Rank of the logit correction."""
    chat_prompts: int = 768
    """Self-distillation prompts (made in out/data unless that folder already holds them)."""
    corpus_sequences: int = 512
    """Teacher-forced corpus windows."""
    everyday_prompts: int = 384
    """Self-distillation prompts of everyday requests (the kind of the held-out prompts, on other
    topics): without them the refiner learns corrections that suit corpus passages only."""
    steps: int = 1500
    """Optimizer steps."""
    learning_rate: float = 1e-3
    """Peak AdamW learning rate."""
    drafted_input_rate: float = 0.3
    """Scheduled-sampling rate reached after the ramp."""
    seed: int = 1
    """Seeds prompts, windows, batches and init. The default differs from the drafter's recipe so the
    refiner learns from text the drafter was not trained on, where its drafts look as at decode time."""
    generate_batch: int = 32
    """Rows decoded together while the target answers the prompts (finished rows are refilled)."""
    dtype: str = "float32"
    """Compute precision of the target (data generation, features, head) and of the frozen drafter
    whose drafts the refiner corrects: bfloat16 feeds bf16 into every dot with float32 accumulation,
    as at decode time under `--dtype bfloat16`. The refiner's weights and optimizer state stay float32."""

    mesh: MeshConfig = MeshConfig()
    """Devices to train over (`--mesh`); one device by default."""

    def __post_init__(self):
        check_compute_dtype(self.dtype)
        check_at_least(0, chat_prompts=self.chat_prompts, corpus_sequences=self.corpus_sequences,
                       everyday_prompts=self.everyday_prompts)
        check_at_least(1, width=self.width, rank=self.rank, steps=self.steps, generate_batch=self.generate_batch)
        check_positive_finite(learning_rate=self.learning_rate)
        if not 0.0 <= self.drafted_input_rate <= 1.0:
            raise SpecjaxError(f"drafted_input_rate must be in [0, 1], got {self.drafted_input_rate}")
        if self.chat_prompts + self.corpus_sequences + self.everyday_prompts == 0:
            raise SpecjaxError("the recipe has no training data: chat_prompts, corpus_sequences and "
                               "everyday_prompts are all 0")

def _log(message: str) -> None:
    print(f"[specjax] {message}", file=sys.stderr, flush=True)


def train_refiner_recipe(model_name: str, drafter_spec: str, out_dir: str | Path,
                         recipe: RefinerRecipe = RefinerRecipe()) -> dict:
    from specjax.io.refiner import save_refiner
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter
    from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics
    from specjax.train.recipe import DistillRecipe, build_data, write_recipe

    out_dir = Path(out_dir)
    model = load_model(model_name, recipe.dtype)
    drafter = resolve_drafter(drafter_spec, model_name)
    # The fingerprint is taken from the drafter as stored, so it matches at any compute precision.
    fingerprint = drafter_fingerprint(drafter.params, drafter.draft_vocab)
    drafter = at_compute_dtype(drafter, recipe.dtype)
    from specjax.io.dflash import check_pair
    check_pair(drafter, model.config)
    write_recipe(out_dir, recipe)
    sets, heldout = build_data(model, DistillRecipe(chat_prompts=recipe.chat_prompts,
                                                    corpus_sequences=recipe.corpus_sequences,
                                                    everyday_prompts=recipe.everyday_prompts, seed=recipe.seed,
                                                    generate_batch=recipe.generate_batch, dtype=recipe.dtype),
                               out_dir / "data", drafter.config.target_layer_ids)
    _log(f"training a {recipe.kind} refiner on {sum(s.num_tokens for s in sets):,} labelled tokens; "
         f"held out {heldout.num_tokens:,}")
    config = RefinerConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.config.block_size,
                           kind=recipe.kind, width=recipe.width, rank=recipe.rank)
    params = train_refiner(
        model.params, model.config, drafter, config, sets, out_dir / "run",
        OptimizerConfig(learning_rate=recipe.learning_rate, warmup_steps=min(100, recipe.steps // 10),
                        total_steps=recipe.steps),
        LoopConfig(steps=recipe.steps, seed=recipe.seed, mesh=recipe.mesh, eval_every=max(recipe.steps // 10, 1),
                   checkpoint_every=max(recipe.steps // 10, 1)),
        RefinerTrainConfig(drafted_input_rate=recipe.drafted_input_rate, ramp_steps=max(recipe.steps // 3, 1)),
        heldout=heldout,
    )
    evals = [m for m in read_metrics(out_dir / "run") if "eval/tau_fixed_point" in m]
    last = evals[-1] if evals else {}
    if is_writer():
        save_refiner(out_dir / "refiner", config, params, fingerprint,
                     dtype="bfloat16", extra={"recipe": dataclasses.asdict(recipe), "drafter": drafter_spec,
                                              **{k.removeprefix("eval/"): v for k, v in last.items()
                                                 if k.startswith("eval/")}})
    return {"refiner": str(out_dir / "refiner"), **{k.removeprefix("eval/"): v for k, v in last.items()
                                                    if k.startswith("eval/")}}
