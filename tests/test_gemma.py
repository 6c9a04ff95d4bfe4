"""Gemma 1, 2 and 3 (text) targets against transformers on tiny random models: (1 + w) norms, scaled
embeddings, GeGLU, sandwich norms, query_pre_attn_scalar, attention and final soft caps, alternating
sliding/full layers and Gemma 3's per-layer RoPE bases, through both attention implementations."""

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
from specjax.models.cache import KVCache
from specjax.models.transformer import forward

from conftest import build_tiny_hf, train_tiny_drafter, transformers_greedy

# Longer than the sliding window (4 keys), so it bites.
PROMPT = [5, 17, 3, 88, 42, 9, 1, 60, 2, 33, 7, 7, 11, 20, 31, 44]


@pytest.fixture(scope="module", params=["gemma", "gemma2", "gemma3"])
def gemma_hf(request, tmp_path_factory):
    model = build_tiny_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def _logits(params, config, tokens=PROMPT):
    cache = KVCache.zeros(config, 1, 32)
    return np.asarray(forward(params, config, jnp.asarray([tokens]), jnp.arange(len(tokens))[None], cache,
                              jnp.zeros((1,), jnp.int32)).logits[0])


def test_config_reads_the_gemma_fields(gemma_hf):
    arch, _, folder = gemma_hf
    config, _ = load_hf_model(folder)
    assert config.norm_unit_offset and config.scale_embeddings and config.hidden_act == "gelu_pytorch_tanh"
    if arch == "gemma":
        assert not config.sandwich_norms and config.sliding_window is None and config.query_pre_attn_scalar is None
        return
    assert config.sandwich_norms and config.query_pre_attn_scalar == 24 and config.sliding_window == 4
    if arch == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (3.0, 4.0)
        assert config.layer_types == ("sliding_attention", "full_attention") and not config.qk_norm
    else:
        assert config.qk_norm and config.attn_logit_softcapping is None
        assert config.layer_rope(0) == (10.0, None)  # sliding layer: local base, no scaling
        assert config.layer_rope(1)[0] == 1000.0 and config.layer_rope(1)[1].factor == 2.0


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_logits_match_transformers(gemma_hf, attention):
    _, model, folder = gemma_hf
    config, params = load_hf_model(folder)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(_logits(params, dataclasses.replace(config, attention=attention)), ref,
                               atol=1e-4, rtol=1e-4)


# Each Gemma feature, switched off, changes the logits clearly: the match above exercises all of them.
FEATURES = {
    "gemma": [dict(norm_unit_offset=False), dict(scale_embeddings=False), dict(hidden_act="silu")],
    "gemma2": [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
               dict(query_pre_attn_scalar=None), dict(sliding_window=None, layer_types=()),
               dict(sandwich_norms=False)],
    "gemma3": [dict(local_rope_theta=None), dict(rope_scaling=None), dict(query_pre_attn_scalar=None),
               dict(sliding_window=None, layer_types=())],
}


def test_every_gemma_feature_matters(gemma_hf):
    arch, model, folder = gemma_hf
    config, params = load_hf_model(folder)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    for change in FEATURES[arch]:
        if change == dict(sandwich_norms=False):  # the extra norms' weights must go too
            layer_params = {k: {n: v for n, v in p.items() if "feedforward" not in n} if k.startswith("layers_") else p
                            for k, p in params.items()}
            changed = _logits(layer_params, dataclasses.replace(config, **change))
        else:
            changed = _logits(params, dataclasses.replace(config, **change))
        assert np.abs(changed - ref).max() > 1e-2, change


def test_greedy_generation_identical_to_transformers(gemma_hf):
    _, model, folder = gemma_hf
    engine = Engine(load_model(str(folder)))
    ours = engine.generate([PROMPT], max_new_tokens=12, ignore_eos=True).tokens[0]
    assert ours == transformers_greedy(model, PROMPT, 12)


def test_save_round_trip(gemma_hf, tmp_path):
    """specjax reloads what it saved unchanged, and transformers loads it as the same model."""
    from transformers import AutoModelForCausalLM

    _, model, folder = gemma_hf
    config, params = load_hf_model(folder)
    save_hf_model(tmp_path, config, params)
    again, again_params = load_hf_model(tmp_path)
    assert again == config
    np.testing.assert_array_equal(_logits(again_params, again), _logits(params, config))
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(torch.tensor([PROMPT])).logits[0].numpy()
        original = model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(reloaded, original, atol=1e-5, rtol=1e-5)


def test_config_variants():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=6, num_attention_heads=2, intermediate_size=8)
    # Gemma 2 written before transformers 5: no layer_types, default soft caps, head_dim 256.
    g2 = config_from_hf({**base, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 8})
    assert g2.layer_types == ("sliding_attention", "full_attention") * 3
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.head_dim) == (50.0, 30.0, 256)
    assert config_from_hf({**base, "model_type": "gemma2", "final_logit_softcapping": None}).final_logit_softcapping is None
    # Gemma 3's older keys: rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern.
    g3 = config_from_hf({**base, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3})
    assert g3.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert g3.layer_rope(0) == (1e4, None) and g3.layer_rope(2)[0] == 1e6 and g3.layer_rope(2)[1].factor == 8.0
    assert config_from_hf({**base, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"}).hidden_act == \
        "gelu_pytorch_tanh"  # Gemma 1's legacy value means the tanh approximation
    with pytest.raises(SpecjaxError, match="bidirectional"):
        config_from_hf({**base, "model_type": "gemma3_text", "use_bidirectional_attention": True})
    with pytest.raises(SpecjaxError, match="multimodal Gemma 3"):
        config_from_hf({**base, "architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(SpecjaxError, match="sliding_window is null"):
        config_from_hf({**base, "model_type": "gemma2", "sliding_window": None})
    with pytest.raises(SpecjaxError, match="hidden_act 'relu'"):
        config_from_hf({**base, "model_type": "gemma2", "hidden_activation": "relu"})


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_incremental_decode_matches_full_forward(attention, tmp_path):
    """Gemma 2 (both caps, sliding layer): prefill 9 tokens, then 4 + 3 through the cache."""
    build_tiny_hf("gemma2").save_pretrained(tmp_path)
    config, params = load_hf_model(tmp_path)
    config = dataclasses.replace(config, attention=attention)
    tokens = jnp.asarray([PROMPT])
    full = _logits(params, config)
    cache, pieces, start = KVCache.zeros(config, 1, 32), [], 0
    for size in (9, 4, 3):
        out = forward(params, config, tokens[:, start:start + size], jnp.arange(start, start + size)[None], cache,
                      jnp.full((1,), start, jnp.int32))
        cache, start = out.cache, start + size
        pieces.append(out.logits[0])
    np.testing.assert_allclose(np.concatenate(pieces), full, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gemma2_pair(tmp_path_factory):
    """A tiny Gemma 2 target and a drafter trained on it for a few seconds."""
    folder = tmp_path_factory.mktemp("gemma2-target")
    build_tiny_hf("gemma2").save_pretrained(folder)
    loaded = load_model(str(folder))
    model = LoadedModel("tiny-gemma2", loaded.config, loaded.params, None, (3,))
    return model, train_tiny_drafter(model, tmp_path_factory.mktemp("gemma2-drafter"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_speculative_decoding_on_gemma_is_exact(gemma2_pair, method):
    """Chain and tree decoding on a Gemma 2 target (soft caps, scaled embeddings shared with the
    drafter, a sliding layer) give its greedy output exactly, with drafts both accepted and rejected."""
    engine = Engine(*gemma2_pair)
    prompts = [PROMPT[:9], PROMPT[:3]]
    reference = engine.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True).tokens
    # A fixed budget: the automatic one may measure drafting as not worth it on this CPU.
    result = engine.generate(prompts, max_new_tokens=24, method=method, ignore_eos=True, tree=TreeConfig(budget=6))
    assert result.tokens == reference
    assert 1.0 < result.stats["tau"] < 1.0 + 4  # some drafts accepted, not all
