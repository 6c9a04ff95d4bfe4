"""Sliding-window targets (Mistral: every layer slides; Qwen3 with layer_types: full and sliding layers
alternate) against transformers, through both attention implementations and every decode method."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.decode.engine import Engine
from specjax.decode.tree import TreeConfig
from specjax.errors import SpecjaxError
from specjax.io.hf import config_from_hf, load_hf_model, save_hf_model
from specjax.io.registry import LoadedModel, load_model
from specjax.models.cache import KVCache, write_ring
from specjax.models.layers import ring_slots
from specjax.models.transformer import forward

from conftest import build_tiny_hf, transformers_greedy

# Longer than every window (4 and 5 keys), so the windows bite.
PROMPT = [5, 17, 3, 88, 42, 9, 1, 60, 2, 33, 7, 7, 11, 20, 31, 44]


@pytest.fixture(scope="module", params=["mistral", "qwen3-sliding"])
def sliding_hf(request, tmp_path_factory):
    model = build_tiny_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def test_config_reads_the_sliding_layers(sliding_hf):
    arch, _, folder = sliding_hf
    config, _ = load_hf_model(folder)
    if arch == "mistral":
        assert config.architecture == "MistralForCausalLM" and config.sliding_window == 5
        assert [config.layer_window(i) for i in range(2)] == [5, 5]
    else:
        assert config.sliding_window == 4 and config.layer_types == ("full_attention", "sliding_attention")
        assert [config.layer_window(i) for i in range(2)] == [None, 4]


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_logits_match_transformers(sliding_hf, attention):
    _, model, folder = sliding_hf
    config, params = load_hf_model(folder)
    config = dataclasses.replace(config, attention=attention)
    cache = KVCache.zeros(config, 1, 32)
    out = forward(params, config, jnp.asarray([PROMPT]), jnp.arange(len(PROMPT))[None], cache,
                  jnp.zeros((1,), jnp.int32))
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    full = dataclasses.replace(config, sliding_window=None, layer_types=())
    out_full = forward(params, full, jnp.asarray([PROMPT]), jnp.arange(len(PROMPT))[None], cache,
                       jnp.zeros((1,), jnp.int32))
    # The window changes the model: without it, late positions differ clearly.
    assert np.abs(np.asarray(out_full.logits[0, -1]) - ref[-1]).max() > 1e-2
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref, atol=1e-4, rtol=1e-4)


def test_greedy_generation_identical_to_transformers(sliding_hf):
    _, model, folder = sliding_hf
    engine = Engine(load_model(str(folder)))
    ours = engine.generate([PROMPT], max_new_tokens=14, ignore_eos=True).tokens[0]
    assert ours == transformers_greedy(model, PROMPT, 14)


def test_save_round_trip_keeps_the_window(sliding_hf, tmp_path):
    arch, _, folder = sliding_hf
    config, params = load_hf_model(folder)
    save_hf_model(tmp_path, config, params)
    again, _ = load_hf_model(tmp_path)
    assert again == config


def test_config_variants():
    base = dict(architectures=["Qwen3ForCausalLM"], vocab_size=10, hidden_size=8, num_hidden_layers=4,
                num_attention_heads=2, intermediate_size=8)
    assert config_from_hf({**base, "sliding_window": 8}).sliding_window is None  # use_sliding_window off
    cfg = config_from_hf({**base, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2})
    assert cfg.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    mistral = dict(base, architectures=["MistralForCausalLM"])
    assert config_from_hf(mistral).sliding_window == 4096  # transformers' default
    assert config_from_hf({**mistral, "sliding_window": None}).sliding_window is None
    with pytest.raises(SpecjaxError, match="layer type 'chunked_attention'"):
        config_from_hf({**base, "use_sliding_window": True, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(SpecjaxError, match="names 2 layers"):
        config_from_hf({**base, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(SpecjaxError, match="not supported"):
        config_from_hf(dict(base, architectures=["Phi3ForCausalLM"]))


@pytest.mark.parametrize("method", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_speculative_decoding_on_a_sliding_target_is_exact(target, drafter, method):
    """The shared tiny target made to slide (window 6 in layer 1): chain and tree decoding give its
    greedy output exactly. Tree nodes sit at slot != position, which the window must respect, and
    the sliding layer decodes with a KV ring that rejected drafts wrap around."""
    sliding = dataclasses.replace(target.config, sliding_window=6, layer_types=("full_attention", "sliding_attention"))
    model = LoadedModel("tiny-sliding", sliding, target.params, None, (3,))
    engine = Engine(model, drafter)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 4, 5], [2, 1, 4]]
    reference = engine.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True).tokens
    plain = Engine(LoadedModel("tiny", target.config, target.params, None, (3,)), drafter)
    assert plain.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True).tokens != reference
    # A fixed tree budget keeps the ring (window + largest tree - 1) shorter than the context.
    result = engine.generate(prompts, max_new_tokens=24, method=method, ignore_eos=True, tree=TreeConfig(budget=6))
    assert result.tokens == reference
    ring = result.stats["memory"]["target_kv_window_bytes"] // (2 * sliding.num_kv_heads * sliding.head_dim * 4)
    assert ring < len(prompts[0]) + 24  # the sliding layer's ring wrapped
    # Padded query rows (--query-rows) write their padding into the ring too; the ring grows to hold it.
    padded = Engine(LoadedModel("tiny-sliding", dataclasses.replace(sliding, query_rows=8), target.params, None, (3,)),
                    drafter)
    assert padded.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True).tokens == reference
    assert padded.generate(prompts, max_new_tokens=24, method=method, ignore_eos=True,
                           tree=TreeConfig(budget=6)).tokens == reference


# ---- KV rings: a sliding layer keeps window + step - 1 slots instead of one per position ----

def test_ring_write_keeps_each_rows_last_real_tokens():
    """write_ring: slot s at index s mod R; of a right-padded block only each row's last R real
    tokens are written (no index twice), and with the default every token of a short block."""
    buffer = jnp.full((2, 5, 1), -1.0)
    update = jnp.arange(1.0, 9.0)[None, :, None].repeat(2, axis=0)  # tokens 1..8 at slots start..start+7
    out = write_ring(buffer, update, jnp.asarray([0, 3]), valid_lengths=jnp.asarray([8, 3]))
    # Row 0: slots 3..7 (tokens 4..8) survive at indices 3, 4, 0, 1, 2. Row 1: slots 3..5 at 3, 4, 0.
    assert out[0, :, 0].tolist() == [6.0, 7.0, 8.0, 4.0, 5.0]
    assert out[1, :, 0].tolist() == [3.0, -1.0, -1.0, 1.0, 2.0]
    short = write_ring(buffer, update[:, :2], jnp.asarray([4, 9]))
    assert short[0, :, 0].tolist() == [2.0, -1.0, -1.0, -1.0, 1.0] and short[1, :, 0].tolist() == [2.0, -1, -1, -1, 1.0]
    # Before a write at index w, ring index i holds slot w - R + (i - w) mod R (negative: never written).
    assert ring_slots(jnp.asarray([7, 2]), 5).tolist() == [[5, 6, 2, 3, 4], [0, 1, -3, -2, -1]]


def test_ring_sizes_and_memory_accounting():
    config = dataclasses.replace(config_from_hf(dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, intermediate_size=8, use_sliding_window=True, sliding_window=40,
        layer_types=["sliding_attention", "full_attention"] * 2)), kv_ring_step=16)
    cache = KVCache.zeros(config, 1, 4096)
    assert [k.shape[1] for k in cache.keys] == [55, 4096, 55, 4096]  # window + step - 1
    assert KVCache.zeros(config, 1, 50).keys[0].shape[1] == 50  # never more slots than positions
    per_slot = 2 * 1 * 4 * 4  # K and V, one kv head of 4 floats
    assert config.kv_bytes_per_token() == 2 * per_slot  # only the two full layers grow
    assert config.kv_window_bytes(4096) == 2 * 55 * per_slot and config.kv_window_bytes(50) == 2 * 50 * per_slot
    full = dataclasses.replace(config, kv_ring_step=None)
    assert full.kv_bytes_per_token() == 4 * per_slot and full.kv_window_bytes(4096) == 0
    # Rings longer than 64 slots are rounded up to a multiple of 64 (the kernels' key block).
    wide = dataclasses.replace(config, sliding_window=100)
    assert KVCache.zeros(wide, 1, 4096).keys[0].shape[1] == 128
    with pytest.raises(ValueError, match="kv_ring_step >= 32"):
        config.check_ring_step(32, "a tree of 32 nodes")
    # Decoding configs: rings only where something slides.
    assert config.with_kv_rings(8).kv_ring_step == 8
    no_sliding = dataclasses.replace(full, sliding_window=None, layer_types=())
    assert no_sliding.with_kv_rings(8) is no_sliding


@pytest.mark.parametrize("attention", ["xla", "pallas"])
@pytest.mark.parametrize("ring_step", [4, pytest.param(None, marks=pytest.mark.slow)])
def test_incremental_decode_matches_full_forward(sliding_hf, attention, ring_step):
    """Prefill 9 tokens, then 4 + 3: every later token's window reaches back into the cache. With
    rings of window + 4 - 1 slots the prefill is longer than the ring and the later steps wrap."""
    _, _, folder = sliding_hf
    config, params = load_hf_model(folder)
    config = dataclasses.replace(config, attention=attention, kv_ring_step=ring_step)
    tokens = jnp.asarray([PROMPT])
    full = forward(params, dataclasses.replace(config, kv_ring_step=None), tokens, jnp.arange(16)[None],
                   KVCache.zeros(config, 1, 32), jnp.zeros((1,), jnp.int32)).logits
    cache, pieces, start = KVCache.zeros(config, 1, 32), [], 0
    if ring_step is not None:
        assert min(k.shape[1] for k in cache.keys) == config.sliding_window + 3 < 9
    for size in (9, 4, 3):
        out = forward(params, config, tokens[:, start:start + size], jnp.arange(start, start + size)[None], cache,
                      jnp.full((1,), start, jnp.int32))
        cache, start = out.cache, start + size
        pieces.append(out.logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=1e-4)


def test_ragged_batch_with_rings_matches_transformers(sliding_hf):
    """A batch of a long and a short prompt (the prefill block is padded far past the short one's
    ring): every row's greedy continuation is transformers', and the rings are what was allocated."""
    _, model, folder = sliding_hf
    engine = Engine(load_model(str(folder)))
    prompts = [PROMPT, PROMPT[:5]]
    result = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert result.tokens == [transformers_greedy(model, p, 10) for p in prompts]
    memory = result.stats["memory"]
    rings = dataclasses.replace(engine.model.config, kv_ring_step=1)  # autoregressive steps write one token
    cache_length = memory["cache_length"]
    assert memory["target_kv_window_bytes"] == rings.kv_window_bytes(cache_length) > 0
    assert memory["target_kv_bytes_per_token"] == rings.kv_bytes_per_token()
    assert memory["target_kv_bytes"] == 2 * (cache_length * rings.kv_bytes_per_token() + rings.kv_window_bytes(cache_length))
