"""Distilling a block-diffusion drafter from a frozen target.

Data: sequences of token ids with the target's hidden states at the drafter's tap layers and the
target's own token labels, computed once (`build_distillation_set`) and stored on disk as
memory-mapped arrays, so training never reruns the target.
  - self-distillation: the target's greedy continuations of prompts; labels are the sequence
    itself, so they are exactly what decoding will have to predict;
  - corpus text: teacher-forced; the label at position t is the target's argmax given the true
    prefix, i.e. the target's own next-token choice.

Training (`drafter_loss`): many random anchors per sequence share one pass. Block j is
[token at anchor a_j, MASK × (B-1)] at positions a_j..a_j+B-1; it sees the context features at
positions < a_j and its own slots (bidirectionally), never other blocks. Slot k's label is the
target's token at a_j + k, weighted by exp(-(k-1)/gamma).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.errors import SpecjaxError
from specjax.models.config import TransformerConfig
from specjax.models.drafter import Drafter, DrafterConfig, context_keys_values
from specjax.models.transformer import embed_tokens, lm_head


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    """How drafter batches are drawn and weighted."""

    sequences_per_batch: int = 4
    """Sequences per step."""
    anchors_per_sequence: int = 32
    """Random blocks per sequence, all trained in one pass."""
    gamma: float = 7.0
    """Slot k's loss weight is exp(-(k-1)/gamma): early slots matter most, since a chain stops at its
    first rejection."""


# ---- distillation data on disk -----------------------------------------------------------------

@dataclasses.dataclass
class DistillationSet:
    """Memory-mapped arrays of one distillation set (see build_distillation_set)."""

    tokens: np.ndarray
    """[N, T] int32 input tokens."""
    labels: np.ndarray
    """[N, T] int32: the target's token at each position (what a drafter must predict)."""
    valid: np.ndarray
    """[N, T] bool: the label at this position may be trained on."""
    features: np.ndarray
    """[N, T, taps, d] float16 target hidden states at the tap layers."""
    target_layer_ids: tuple[int, ...]

    @classmethod
    def open(cls, folder: str | Path) -> "DistillationSet":
        folder = Path(folder)
        meta_path = folder / "meta.json"
        if not meta_path.exists():
            raise SpecjaxError(f"{folder}: not a distillation set (no meta.json)")
        meta = json.loads(meta_path.read_text())
        n, t, taps, d = meta["shape"]
        open_ = lambda name, dtype, shape: np.memmap(folder / name, dtype=dtype, mode="r", shape=tuple(shape))
        return cls(
            tokens=open_("tokens.i32", np.int32, (n, t)),
            labels=open_("labels.i32", np.int32, (n, t)),
            valid=open_("valid.u8", np.uint8, (n, t)).view(bool),
            features=open_("features.f16", np.float16, (n, t, taps, d)),
            target_layer_ids=tuple(meta["target_layer_ids"]),
        )

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())


def build_distillation_set(target_params, target_config: TransformerConfig, sequences: Iterable[tuple[Sequence[int], int]],
                           out_dir: str | Path, target_layer_ids: tuple[int, ...], seq_len: int,
                           teacher_labels: bool, batch_size: int = 8, progress: bool = True) -> DistillationSet:
    """Run the target over sequences and store features and labels.

    sequences: (token ids, first trainable position) pairs; ids are cut or padded to seq_len.
    teacher_labels: True for corpus text (labels = target argmax of the previous position);
    False for the target's own continuations (labels = the tokens themselves).
    """
    from tqdm.auto import tqdm

    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [(list(ids)[:seq_len], start) for ids, start in sequences]
    rows = [(ids, start) for ids, start in rows if len(ids) > start + 1]
    if not rows:
        raise SpecjaxError("no sequence has a trainable position")
    n, taps, d = len(rows), len(target_layer_ids), target_config.hidden_size
    create = lambda name, dtype, shape: np.memmap(out_dir / name, dtype=dtype, mode="w+", shape=shape)
    tokens = create("tokens.i32", np.int32, (n, seq_len))
    labels = create("labels.i32", np.int32, (n, seq_len))
    valid = create("valid.u8", np.uint8, (n, seq_len))
    features = create("features.f16", np.float16, (n, seq_len, taps, d))

    @jax.jit
    def run(batch):
        b = batch.shape[0]
        cache = KVCache.zeros(target_config, b, seq_len)
        positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), batch.shape)
        out = forward(target_params, target_config, batch, positions, cache, jnp.zeros((b,), jnp.int32),
                      hidden_layers=target_layer_ids)
        return out.hidden.astype(jnp.float16), jnp.argmax(out.logits, axis=-1).astype(jnp.int32)

    for begin in tqdm(range(0, n, batch_size), desc="target features", disable=not progress, unit="batch"):
        chunk = rows[begin : begin + batch_size]
        batch = np.zeros((batch_size, seq_len), np.int32)  # fixed batch shape: one compilation
        for i, (ids, _) in enumerate(chunk):
            batch[i, : len(ids)] = ids
        hidden, argmax = (np.asarray(a) for a in run(jnp.asarray(batch)))
        for i, (ids, start) in enumerate(chunk):
            row = begin + i
            tokens[row] = batch[i]
            features[row] = hidden[i]
            if teacher_labels:
                labels[row, 1:] = argmax[i, :-1]
            else:
                labels[row] = batch[i]
            mask = np.zeros(seq_len, np.uint8)
            mask[max(start, 1) : len(ids)] = 1
            valid[row] = mask
    for array in (tokens, labels, valid, features):
        array.flush()
    (out_dir / "meta.json").write_text(json.dumps({
        "shape": [n, seq_len, taps, d], "target_layer_ids": list(target_layer_ids),
        "teacher_labels": teacher_labels,
    }))
    return DistillationSet.open(out_dir)


def sample_drafter_batch(data: DistillationSet, step: int, seed: int, cfg: DrafterTrainConfig, block: int) -> dict:
    """A batch of sequences and anchors; a pure function of (seed, step) so resumes are exact."""
    rng = np.random.default_rng([seed, step, 7])
    rows = rng.integers(0, data.num_sequences, size=cfg.sequences_per_batch)
    seq_len = data.tokens.shape[1]
    anchors = np.zeros((len(rows), cfg.anchors_per_sequence), np.int32)
    for i, r in enumerate(rows):
        # An anchor is useful when its first drafted slot has a valid label.
        allowed = np.flatnonzero(data.valid[r, 1:]) if seq_len > 1 else np.zeros(0, int)
        allowed = allowed[allowed < seq_len - 1]
        if len(allowed) == 0:
            allowed = np.array([0])
        anchors[i] = rng.choice(allowed, size=cfg.anchors_per_sequence, replace=len(allowed) < cfg.anchors_per_sequence)
    return {
        "tokens": np.asarray(data.tokens[rows]),
        "labels": np.asarray(data.labels[rows]),
        "valid": np.asarray(data.valid[rows]),
        "features": np.asarray(data.features[rows]),
        "anchors": np.sort(anchors, axis=1),
    }


def drafter_block_logits(drafter_params, drafter_config: DrafterConfig, target_params, target_config: TransformerConfig,
                         tokens, features, anchors):
    """Logits of every anchor's block in one pass. tokens: [b, T]; features: [b, T, taps, d];
    anchors: [b, A]. Returns [b, A, B-1, V] for slots 1..B-1."""
    b, seq_len = tokens.shape
    num_anchors, block = anchors.shape[1], drafter_config.block_size
    slot = jnp.arange(block, dtype=jnp.int32)
    positions = (anchors[:, :, None] + slot).reshape(b, num_anchors * block)  # [b, A*Bk]
    anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1)  # [b, A]
    is_mask = jnp.broadcast_to(slot > 0, (b, num_anchors, block)).reshape(b, -1)
    fill = drafter_config.mask_token_id if drafter_config.mask_token_id is not None else 0
    block_tokens = jnp.where(is_mask, fill, jnp.repeat(anchor_tokens, block, axis=1))
    drafter = Drafter(drafter_config)
    x = drafter.apply({"params": drafter_params}, embed_tokens(target_params, target_config, block_tokens), is_mask,
                      method=Drafter.block_inputs)  # [b, A*Bk, d]
    ctx_positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b, seq_len))
    kv = context_keys_values(drafter_params, drafter_config, features, ctx_positions)
    # Block-sparse mask as [queries, context + blocks]: context strictly before the anchor, plus own block.
    query_anchor = jnp.repeat(anchors, block, axis=1)  # [b, A*Bk]
    sees_context = jnp.arange(seq_len)[None, None, :] < query_anchor[:, :, None]  # [b, A*Bk, T]
    block_id = jnp.repeat(jnp.arange(num_anchors), block)
    sees_block = jnp.broadcast_to(block_id[:, None] == block_id[None, :], (b, num_anchors * block, num_anchors * block))
    mask = jnp.concatenate([sees_context, sees_block], axis=2)
    h = drafter.apply({"params": drafter_params}, x, positions, tuple(k for k, _ in kv), tuple(v for _, v in kv), mask)
    h = h.reshape(b, num_anchors, block, -1)[:, :, 1:]  # [b, A, K, d]
    return lm_head(target_params, target_config, h.reshape(b, num_anchors * (block - 1), -1)).reshape(
        b, num_anchors, block - 1, -1)


def drafter_loss(drafter_params, batch: dict, *, drafter_config: DrafterConfig, target_params,
                 target_config: TransformerConfig, gamma: float):
    """Decay-weighted cross-entropy over block slots. Returns (loss, {"slot1_accuracy": ...})."""
    block = drafter_config.block_size
    logits = drafter_block_logits(drafter_params, drafter_config, target_params, target_config, batch["tokens"],
                                  batch["features"], batch["anchors"])  # [b, A, K, V]
    seq_len = batch["tokens"].shape[1]
    label_pos = batch["anchors"][:, :, None] + jnp.arange(1, block)  # [b, A, K]
    in_range = label_pos < seq_len
    label_pos = jnp.minimum(label_pos, seq_len - 1)
    gather = lambda a: jnp.take_along_axis(a, label_pos.reshape(a.shape[0], -1), axis=1).reshape(label_pos.shape)
    labels = gather(batch["labels"])
    weight = in_range & gather(batch["valid"])
    weight = weight * jnp.exp(-(jnp.arange(1, block) - 1) / gamma)  # [b, A, K]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = jnp.sum(ce * weight) / jnp.maximum(jnp.sum(weight), 1e-6)
    hit = (jnp.argmax(logits, -1) == labels) & (weight > 0)
    slot1 = jnp.sum(hit[..., 0]) / jnp.maximum(jnp.sum(weight[..., 0] > 0), 1)
    return loss, {"slot1_accuracy": slot1}


def estimate_tau_array(drafter_params, drafter_config: DrafterConfig, target_params, target_config: TransformerConfig,
                       batch: dict) -> jax.Array:
    """Held-out acceptance-length estimate under teacher forcing: for each anchor, 1 + the number of
    leading slots whose argmax equals the label (what greedy chain decoding would commit)."""
    logits = drafter_block_logits(drafter_params, drafter_config, target_params, target_config, batch["tokens"],
                                  batch["features"], batch["anchors"])
    block = drafter_config.block_size
    seq_len = batch["tokens"].shape[1]
    label_pos = batch["anchors"][:, :, None] + jnp.arange(1, block)
    ok = label_pos < seq_len
    label_pos = jnp.minimum(label_pos, seq_len - 1)
    flat = label_pos.reshape(label_pos.shape[0], -1)
    labels = jnp.take_along_axis(batch["labels"], flat, axis=1).reshape(label_pos.shape)
    valid = jnp.take_along_axis(batch["valid"], flat, axis=1).reshape(label_pos.shape) & ok
    match = (jnp.argmax(logits, -1) == labels) & valid
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)  # [b, A]
    usable = valid[..., 0]
    return jnp.sum((accepted + 1) * usable) / jnp.maximum(jnp.sum(usable), 1)


def train_drafter(target_params, target_config: TransformerConfig, drafter_config: DrafterConfig,
                  data: DistillationSet, out_dir: str | Path, optimizer=None, loop=None,
                  train_config: DrafterTrainConfig = DrafterTrainConfig(), heldout: DistillationSet | None = None,
                  init_params=None):
    """Train a drafter on a distillation set with the target frozen. Resumes from out_dir.

    Logs loss, slot-1 accuracy and (with a held-out set) the teacher-forced acceptance-length
    estimate `eval/tau_estimate`. Returns the trained drafter params.
    """
    from specjax.models.drafter import init_drafter_params
    from specjax.train.loop import LoopConfig, OptimizerConfig, train

    drafter_config.check_target(target_config)
    if tuple(data.target_layer_ids) != tuple(drafter_config.target_layer_ids):
        raise SpecjaxError(f"the distillation set holds target layers {data.target_layer_ids}, "
                           f"the drafter taps {drafter_config.target_layer_ids}")
    optimizer = optimizer or OptimizerConfig()
    loop = loop or LoopConfig()
    params = init_params if init_params is not None else init_drafter_params(drafter_config, jax.random.key(loop.seed))

    def loss_fn(p, batch, rng):
        return drafter_loss(p, batch, drafter_config=drafter_config, target_params=target_params,
                            target_config=target_config, gamma=train_config.gamma)

    block = drafter_config.block_size
    batch_fn = lambda step: jax.tree.map(jnp.asarray, sample_drafter_batch(data, step, loop.seed, train_config, block))
    eval_fn = None
    if heldout is not None:
        eval_batches = [jax.tree.map(jnp.asarray, sample_drafter_batch(heldout, i, 12345, train_config, block))
                        for i in range(4)]
        tau = jax.jit(lambda p, b: estimate_tau_array(p, drafter_config, target_params, target_config, b))
        eval_fn = lambda p: {"tau_estimate": float(np.mean([tau(p, b) for b in eval_batches]))}
    trained, _ = train(loss_fn, params, batch_fn, out_dir, optimizer, loop, eval_fn=eval_fn)
    return trained
