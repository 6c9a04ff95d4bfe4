"""Training the segment compressor of windowed drafting, with the drafter frozen.

The windowed drafter sees the last `window` context positions raw and, for older context, only the
compressor's summary tokens. Training minimises the drafter's usual decay-weighted block loss
(train/drafter.py) under exactly that view of long sequences, with optax updating the compressor
alone. Sequences must be longer than the window, or the summaries are never needed: long
documents (novels, plays) cut into windows of 1-2k tokens suit it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError, check_at_least, check_compute_dtype, check_positive_finite
from specjax.models.config import TransformerConfig
from specjax.models.drafter import DrafterConfig, DrafterWindow, init_compressor_params
from specjax.sharding import MeshConfig, built_once, is_writer
from specjax.train.drafter import (DistillationSet, DrafterTrainConfig, check_taps, drafter_loss, heldout_tau,
                                   label_index_for, sample_drafter_batch)


def train_compressor(target_params, target_config: TransformerConfig, drafter_config: DrafterConfig, drafter_params,
                     window: DrafterWindow, data: DistillationSet | Sequence[DistillationSet], out_dir: str | Path,
                     optimizer=None, loop=None, train_config: DrafterTrainConfig = DrafterTrainConfig(),
                     heldout: DistillationSet | None = None, draft_vocab=None, attention: str = "xla"):
    """Train a compressor for a frozen drafter. Resumes from out_dir. Returns the compressor params.

    Logs loss and slot-1 accuracy; with a held-out set, the teacher-forced acceptance-length
    estimate `eval/tau_estimate` of the windowed drafter. attention="pallas" runs the context
    window through the windowed-attention kernels (forward and backward).
    """
    from specjax.train.loop import LoopConfig, OptimizerConfig, train

    drafter_config.check_target(target_config)
    check_taps(data, drafter_config)
    sets = [data] if isinstance(data, DistillationSet) else list(data)
    if sets[0].tokens.shape[1] <= window.window:
        raise SpecjaxError(f"training sequences of {sets[0].tokens.shape[1]} tokens never leave a window of "
                           f"{window.window}; use longer sequences or a smaller window")
    windowed_config = dataclasses.replace(drafter_config, window=window)
    optimizer = optimizer or OptimizerConfig()
    loop = loop or LoopConfig()
    frozen = {k: v for k, v in drafter_params.items() if k != "compressor"}
    compressor = init_compressor_params(windowed_config, jax.random.key(loop.seed))
    draft_vocab = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)
    label_index = label_index_for(draft_vocab, target_config.vocab_size)

    def loss_fn(params, batch, rng):
        return drafter_loss({**frozen, "compressor": params}, batch, drafter_config=windowed_config,
                            target_params=target_params, target_config=target_config, gamma=train_config.gamma,
                            draft_vocab=draft_vocab, label_index=label_index, attention=attention)

    block = drafter_config.block_size
    batch_fn = lambda step: jax.tree.map(jnp.asarray, sample_drafter_batch(data, step, loop.seed, train_config, block))
    eval_fn = None
    if heldout is not None:
        tau = heldout_tau(heldout, train_config, windowed_config, target_params, target_config, draft_vocab,
                          params_of=lambda p: {**frozen, "compressor": p})
        eval_fn = lambda p: {"tau_estimate": tau(p)}
    trained, _ = train(loss_fn, compressor, batch_fn, out_dir, optimizer, loop, eval_fn=eval_fn)
    return trained


@dataclasses.dataclass(frozen=True)
class CompressorRecipe:
    """How `specjax train-compressor` builds long-context data and trains a compressor."""

    window: int = 256
    """Raw context positions the drafter sees while training (decode may use another)."""
    segment: int = 128
    """Positions per summarised segment."""
    summaries: int = 2
    """Summary tokens per segment."""
    seq_len: int = 1024
    """Tokens per training sequence: several windows long, so most anchors need summaries."""
    sequences: int = 96
    """Teacher-forced training windows cut from the training split's long documents."""
    heldout_sequences: int = 12
    """Windows from the held-out documents, for the tau estimate."""
    corpora: tuple[str, ...] = ("austen", "gutenberg_novels", "shakespeare")
    """Corpora of long documents (novels, plays)."""
    steps: int = 300
    learning_rate: float = 3e-3
    sequences_per_batch: int = 4
    anchors_per_sequence: int = 32
    seed: int = 0
    dtype: str = "float32"
    """Compute precision of the target (the long windows' features) and of the frozen drafter the
    compressor feeds: bfloat16 feeds bf16 into every dot with float32 accumulation, as at decode time
    under `--dtype bfloat16`. The compressor's weights and optimizer state stay float32."""

    mesh: MeshConfig = MeshConfig()
    """Devices to train over (`--mesh`); one device by default."""

    def __post_init__(self):
        check_compute_dtype(self.dtype)
        check_at_least(1, window=self.window, segment=self.segment, summaries=self.summaries,
                       seq_len=self.seq_len, sequences=self.sequences, heldout_sequences=self.heldout_sequences,
                       steps=self.steps, sequences_per_batch=self.sequences_per_batch,
                       anchors_per_sequence=self.anchors_per_sequence)
        check_positive_finite(learning_rate=self.learning_rate)

def _long_document_windows(tokenizer, documents, count: int, seq_len: int, first_trainable: int, seed: int):
    """`count` windows of seq_len tokens at random offsets of random long documents."""
    rng = np.random.default_rng(seed)
    long_docs = [d for d in documents if len(d.text) > 8 * seq_len]
    if not long_docs:
        raise SpecjaxError(f"no document is long enough for windows of {seq_len} tokens")
    windows = []
    while len(windows) < count:
        doc = long_docs[int(rng.integers(0, len(long_docs)))]
        start = int(rng.integers(0, len(doc.text) - 8 * seq_len))
        ids = tokenizer.encode(doc.text[start : start + 8 * seq_len], add_special_tokens=False)
        if len(ids) >= seq_len:
            windows.append((ids[:seq_len], first_trainable))
    return windows


def train_compressor_recipe(model_name: str, drafter_spec: str, out_dir: str | Path,
                            recipe: CompressorRecipe = CompressorRecipe()) -> dict:
    """Build long-document data, train a compressor for the drafter, save it (bf16) to out/compressor
    and report the held-out tau estimates of the full-attention, windowed-untrained (mean-pooled
    summaries) and windowed-trained drafter."""
    import json

    from specjax.data.corpora import load_split
    from specjax.io.compressor import save_compressor
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter
    from specjax.models.refiner import drafter_fingerprint
    from specjax.train.drafter import build_distillation_set
    from specjax.train.loop import LoopConfig, OptimizerConfig
    from specjax.train.recipe import write_recipe

    out_dir = Path(out_dir)
    write_recipe(out_dir, recipe)
    model = load_model(model_name, recipe.dtype)
    drafter = resolve_drafter(drafter_spec, model_name)
    # The fingerprint is taken from the drafter as stored, so it matches at any compute precision.
    fingerprint = drafter_fingerprint(drafter.params, drafter.draft_vocab)
    drafter = at_compute_dtype(drafter, recipe.dtype)
    taps = drafter.config.target_layer_ids
    window = DrafterWindow(recipe.window, recipe.segment, recipe.summaries)
    train_docs, heldout_docs = load_split(recipe.corpora)

    def data(name: str, documents, count: int, seed: int):
        folder = out_dir / "data" / name

        def build() -> None:
            windows = _long_document_windows(model.tokenizer, documents, count, recipe.seq_len, recipe.window // 2,
                                             seed)
            build_distillation_set(model.params, model.config, windows, folder, taps, recipe.seq_len,
                                   teacher_labels=True, batch_size=4)

        built_once(lambda: (folder / "meta.json").exists(), build, f"{name} data in {folder}")
        return DistillationSet.open(folder)

    train_set = data("train", train_docs, recipe.sequences, recipe.seed)
    heldout = data("heldout", heldout_docs, recipe.heldout_sequences, recipe.seed + 1)
    train_config = DrafterTrainConfig(sequences_per_batch=recipe.sequences_per_batch,
                                      anchors_per_sequence=recipe.anchors_per_sequence)
    params = train_compressor(
        model.params, model.config, drafter.config, drafter.params, window, train_set, out_dir / "run",
        OptimizerConfig(learning_rate=recipe.learning_rate, warmup_steps=min(50, recipe.steps // 10),
                        total_steps=recipe.steps, weight_decay=0.0),
        LoopConfig(steps=recipe.steps, seed=recipe.seed, mesh=recipe.mesh, eval_every=max(recipe.steps // 5, 1),
                   checkpoint_every=max(recipe.steps // 5, 1)),
        train_config, heldout=heldout, draft_vocab=drafter.draft_vocab)
    if is_writer():
        save_compressor(out_dir / "compressor", window, drafter.config.hidden_size, params, fingerprint,
                        dtype="bfloat16", extra={"recipe": dataclasses.asdict(recipe)})

    def tau(config, drafter_params):
        return heldout_tau(heldout, train_config, config, model.params, model.config, drafter.draft_vocab)(
            drafter_params)

    windowed_config = dataclasses.replace(drafter.config, window=window)
    untrained = init_compressor_params(windowed_config, jax.random.key(0))
    summary = {
        "compressor": str(out_dir / "compressor"),
        "tau_full_attention": tau(drafter.config, drafter.params),
        "tau_windowed_untrained": tau(windowed_config, {**drafter.params, "compressor": untrained}),
        "tau_windowed_trained": tau(windowed_config, {**drafter.params, "compressor": params}),
        "train_tokens": train_set.num_tokens,
    }
    if is_writer():
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
