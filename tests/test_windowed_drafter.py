"""Windowed drafting with summary tokens: the bounded decode state reproduces the training view of the
context step by step, its size stays flat with context, decoding stays exact, and the compressor trains."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode.context import (WindowedContext, append_context, context_state_bytes, empty_context_cache,
                                    prefill_context)
from specjax.decode.engine import Engine
from specjax.decode.sampling import SamplingConfig
from specjax.decode.speculative import draft_block_states
from specjax.errors import SpecjaxError
from specjax.io.compressor import load_compressor, save_compressor, windowed_drafter
from specjax.models.drafter import DrafterConfig, DrafterWindow, init_compressor_params
from specjax.models.config import TransformerConfig
from specjax.train.drafter import drafter_block_states, drafter_loss

from stats import chi_square_pvalue
from test_decode import TINY
from test_speculative import _exact_marginals


def with_random_compressor(drafter, window: DrafterWindow, seed: int = 0):
    """The tiny drafter made windowed, with a compressor whose queries are random (an untrained one
    pools uniformly, which would hide bugs in which states get pooled)."""
    config = dataclasses.replace(drafter.config, window=window)
    compressor = init_compressor_params(config, jax.random.key(seed))
    compressor["queries"] = jax.random.normal(jax.random.key(seed + 1), compressor["queries"].shape)
    return dataclasses.replace(drafter, config=config, params={**drafter.params, "compressor": compressor})


@pytest.mark.slow  # greedy/sampled windowed decoding and the summaries-only check stay in the default suite
def test_decode_state_reproduces_the_training_view(target, drafter):
    """Prefill ragged prompts, then commit blocks of varying length (with rejected garbage written
    past the commit): at every step the drafter's states from the bounded decode state equal those
    the training path computes from the whole sequence, across segment boundaries."""
    windowed = with_random_compressor(drafter, DrafterWindow(window=6, segment=5, summaries=2))
    cfg = windowed.config
    rng = np.random.default_rng(0)
    batch, length = 2, 48
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (batch, length)), jnp.int32)
    features = jnp.asarray(rng.standard_normal((batch, length, cfg.num_taps, TINY.hidden_size)), jnp.float32)
    prompt_lengths = jnp.array([13, 7])
    context = prefill_context(windowed.params, cfg, batch, 64, features[:, :13], prompt_lengths)
    lengths = prompt_lengths
    block = cfg.block_size
    for advance in [(3, 1), (1, 4), (4, 4), (2, 1), (4, 3), (1, 2), (3, 4), (4, 1)]:
        decoded = draft_block_states(target.params, TINY, windowed.params, cfg, tokens[jnp.arange(batch), lengths],
                                     lengths, context)  # [B, K, d]
        trained = drafter_block_states(windowed.params, cfg, target.params, TINY, tokens, features,
                                       lengths[:, None])[:, 0]  # [B, K, d]
        np.testing.assert_allclose(decoded, trained, atol=2e-5, rtol=2e-5)
        positions = lengths[:, None] + jnp.arange(block)
        step_features = jnp.take_along_axis(features, positions[:, :, None, None], axis=1)
        advance = jnp.asarray(advance)
        garbage = jnp.arange(block)[None, :] >= advance[:, None]
        step_features = jnp.where(garbage[:, :, None, None], 50.0, step_features)  # rejected drafts' features
        context = append_context(windowed.params, cfg, context, step_features, positions, lengths, lengths + advance)
        lengths = lengths + advance
    assert int(lengths.min()) > 3 * cfg.window.segment  # several segments were summarised on the way


@pytest.mark.slow  # suite time budget; windowed decoding exactness stays in the default suite
def test_old_context_reaches_the_drafter_only_through_summaries(target, drafter):
    """Positions older than the window change the draft through their segment's summary; future
    positions never do."""
    windowed = with_random_compressor(drafter, DrafterWindow(window=5, segment=5, summaries=1))
    cfg = windowed.config
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (1, 30)), jnp.int32)
    features = jnp.asarray(rng.standard_normal((1, 30, cfg.num_taps, TINY.hidden_size)), jnp.float32)

    def states(f, anchor):
        return np.asarray(drafter_block_states(windowed.params, cfg, target.params, TINY, tokens, f,
                                               jnp.array([[anchor]])))

    base = states(features, 14)  # raw window: positions 9..13; summaries of segments 0..4 and 5..9
    for old in (2, 7):
        assert np.abs(states(features.at[:, old].set(9.0), 14) - base).max() > 1e-4, old
    np.testing.assert_array_equal(states(features.at[:, 16].set(9.0), 14), base)


def test_state_stays_flat_with_context():
    """SmolLM2-shaped drafter with the default window: the state at 8k is within 1.25x of 1k, while
    the full-attention cache grows 8x (no arrays are allocated: shapes only)."""
    target_config = TransformerConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                      head_dim=64, intermediate_size=1536)
    full = DrafterConfig.for_target(target_config, num_layers=1)
    windowed = dataclasses.replace(full, window=DrafterWindow())
    full_bytes = [context_state_bytes(full, 1, n) for n in (1024, 8192)]
    windowed_bytes = [context_state_bytes(windowed, 1, n) for n in (1024, 8192)]
    assert full_bytes[1] / full_bytes[0] == pytest.approx(8.0)
    assert windowed_bytes[1] / windowed_bytes[0] <= 1.25
    assert isinstance(empty_context_cache(windowed, 1, 64), WindowedContext)


@pytest.mark.parametrize("method", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_greedy_windowed_decoding_equals_autoregressive(target, drafter, method):
    windowed = with_random_compressor(drafter, DrafterWindow(window=5, segment=4, summaries=2))
    prompts = [[1, 5, 2, 7, 7, 1, 9, 4, 2, 2, 6], [3, 4]]
    reference = Engine(target).generate(prompts, 30, ignore_eos=True).tokens
    result = Engine(target, windowed).generate(prompts, 30, ignore_eos=True, method=method)
    assert result.tokens == reference
    assert result.stats["tau"] > 1.0  # the drafter still drafts something useful


@pytest.mark.slow
def test_sampled_windowed_chain_matches_the_exact_target_distribution(target, drafter):
    windowed = with_random_compressor(drafter, DrafterWindow(window=4, segment=4, summaries=2))
    prompt = [1, 5, 2]
    sampling = SamplingConfig(temperature=1.0)
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth=3)
    out = np.asarray(Engine(target, windowed).generate([prompt] * 20_000, 3, sampling, seed=5, ignore_eos=True,
                                                       method="chain").tokens)
    for position in range(3):
        counts = np.bincount(out[:, position], minlength=TINY.vocab_size)
        assert chi_square_pvalue(counts, exact[position]) > 1e-3, f"token {position + 1}"


@pytest.mark.slow
def test_pallas_training_path_matches_xla(target, drafter):
    """The windowed drafter's loss and compressor gradients through the windowed-attention kernels
    (interpreted) equal the dense XLA path's."""
    windowed = with_random_compressor(drafter, DrafterWindow(window=8, segment=4, summaries=2))
    rng = np.random.default_rng(2)
    batch = {"tokens": jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 40)), jnp.int32),
             "labels": jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 40)), jnp.int32),
             "valid": jnp.ones((2, 40), bool),
             "features": jnp.asarray(rng.standard_normal((2, 40, windowed.config.num_taps, TINY.hidden_size)),
                                     jnp.float32),
             "anchors": jnp.asarray(np.sort(rng.integers(0, 36, (2, 5)), axis=1), jnp.int32)}
    frozen = {k: v for k, v in windowed.params.items() if k != "compressor"}

    def loss(compressor, attention):
        return drafter_loss({**frozen, "compressor": compressor}, batch, drafter_config=windowed.config,
                            target_params=target.params, target_config=TINY, gamma=7.0, attention=attention)[0]

    xla_loss, xla_grad = jax.value_and_grad(loss)(windowed.params["compressor"], "xla")
    pallas_loss, pallas_grad = jax.value_and_grad(loss)(windowed.params["compressor"], "pallas")
    np.testing.assert_allclose(pallas_loss, xla_loss, rtol=1e-5)
    for a, e in zip(jax.tree.leaves(pallas_grad), jax.tree.leaves(xla_grad)):
        assert np.abs(np.asarray(e)).max() > 0
        np.testing.assert_allclose(a, e, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compressor_trains_saves_and_loads(target, drafter, tmp_path):
    from conftest import tiny_distillation_set
    from specjax.train.compressor import train_compressor
    from specjax.train.drafter import DrafterTrainConfig
    from specjax.train.loop import LoopConfig, OptimizerConfig

    data = tiny_distillation_set(target, tmp_path / "data", 3, n=16)  # 48-token sequences
    window = DrafterWindow(window=6, segment=4, summaries=2)
    params = train_compressor(target.params, TINY, drafter.config, drafter.params, window, data, tmp_path / "run",
                              OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=30),
                              LoopConfig(steps=30, log_every=1, eval_every=0, checkpoint_every=30, progress=False),
                              DrafterTrainConfig(sequences_per_batch=4, anchors_per_sequence=8))
    from specjax.train.loop import read_metrics
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert len(losses) >= 6
    assert np.mean(losses[-3:]) < np.mean(losses[:3])

    from specjax.models.refiner import drafter_fingerprint
    save_compressor(tmp_path / "compressor", window, TINY.hidden_size, params,
                    drafter_fingerprint(drafter.params, drafter.draft_vocab))
    loaded = load_compressor(tmp_path / "compressor")
    assert loaded.window == window
    made = windowed_drafter(drafter, loaded, window=5)
    assert made.config.window == DrafterWindow(window=5, segment=4, summaries=2)
    with pytest.raises(SpecjaxError, match="at least the segment"):
        windowed_drafter(drafter, loaded, window=3)
    other = dataclasses.replace(drafter, params=jax.tree.map(lambda x: x + 1.0, drafter.params), source="other")
    with pytest.raises(SpecjaxError, match="retrain it"):
        windowed_drafter(other, loaded)
    with pytest.raises(SpecjaxError, match="segment=2 must be at least the block size"):
        windowed_drafter(drafter, dataclasses.replace(loaded, window=DrafterWindow(6, 2, 2)))
    with pytest.raises(SpecjaxError, match="not a compressor folder"):
        load_compressor(tmp_path / "missing")


def test_committed_compressor_pairs_with_the_committed_drafter():
    from specjax.io.registry import resolve_compressor, resolve_drafter

    drafter = resolve_drafter("default", "smollm2")
    compressor = resolve_compressor("default", "smollm2")
    assert compressor.window == DrafterWindow(window=256, segment=128, summaries=2)
    windowed = windowed_drafter(drafter, compressor, window=512)
    assert windowed.config.window.window == 512 and "compressor" in windowed.params
    assert windowed_drafter(drafter, compressor).config.window == compressor.window
