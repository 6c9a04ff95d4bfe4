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

from specjax.errors import SpecjaxError
from specjax.models.config import TransformerConfig
from specjax.models.drafter import DrafterConfig, DrafterWindow, init_compressor_params
from specjax.train.drafter import (DistillationSet, DrafterTrainConfig, check_taps, drafter_loss, estimate_tau_array,
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
        eval_batches = [jax.tree.map(jnp.asarray, sample_drafter_batch(heldout, i, 12345, train_config, block))
                        for i in range(4)]
        tau = jax.jit(lambda p, b: estimate_tau_array({**frozen, "compressor": p}, windowed_config, target_params,
                                                      target_config, b, draft_vocab, label_index))
        eval_fn = lambda p: {"tau_estimate": float(np.mean([tau(p, b) for b in eval_batches]))}
    trained, _ = train(loss_fn, compressor, batch_fn, out_dir, optimizer, loop, eval_fn=eval_fn)
    return trained
