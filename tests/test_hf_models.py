"""specjax's decoder against the transformers reference, on tiny random Llama and Qwen3 models."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.decode.engine import Engine
from specjax.errors import SpecjaxError
from specjax.io.hf import load_hf_model, save_hf_model
from specjax.io.registry import load_model
from specjax.models.cache import KVCache
from specjax.models.transformer import forward

from conftest import build_tiny_hf, transformers_greedy

PROMPTS = [[5, 17, 3, 88, 42, 9, 1], [60, 2, 33], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 11]]


def _specjax_logits(config, params, ids):
    cache = KVCache.zeros(config, 1, 64)
    pos = jnp.arange(len(ids))[None]
    out = forward(params, config, jnp.asarray([ids]), pos, cache, jnp.zeros((1,), jnp.int32), hidden_layers=(0, 1))
    return np.asarray(out.logits[0]), np.asarray(out.hidden[0])


def test_logits_and_hidden_states_match_transformers(tiny_hf):
    arch, model, folder = tiny_hf
    config, params = load_hf_model(folder)
    assert config.architecture == ("Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM")
    assert config.qk_norm == (arch == "qwen3")
    ids = PROMPTS[0] + PROMPTS[2]
    logits, hidden = _specjax_logits(config, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    ref_logits = ref.logits[0].numpy()
    assert np.abs(ref_logits).max() > 3.0  # the weights give a real spread of logits
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # Hidden layer i is HF's hidden_states[i + 1] (index 0 is the embedding output). The last one
    # HF reports after the final norm, so compare the first tapped layer only.
    np.testing.assert_allclose(hidden[:, 0], ref.hidden_states[1][0].numpy(), atol=1e-4, rtol=1e-4)


def test_greedy_continuations_identical_to_transformers(tiny_hf):
    _, model, folder = tiny_hf
    engine = Engine(load_model(str(folder)))
    for ids in PROMPTS:
        ours = engine.generate([ids], max_new_tokens=12, ignore_eos=True).tokens[0]
        assert ours == transformers_greedy(model, ids, 12)


def test_ragged_batch_equals_one_prompt_at_a_time(tiny_hf):
    _, _, folder = tiny_hf
    engine = Engine(load_model(str(folder)))
    batched = engine.generate(PROMPTS, max_new_tokens=10, ignore_eos=True).tokens
    single = [engine.generate([p], max_new_tokens=10, ignore_eos=True).tokens[0] for p in PROMPTS]
    assert batched == single


def test_incremental_decode_matches_full_forward(tiny_hf):
    """Writing at a per-row cache index, one token at a time, reproduces the one-shot logits."""
    _, _, folder = tiny_hf
    config, params = load_hf_model(folder)
    ids = PROMPTS[0]
    full, _ = _specjax_logits(config, params, ids)
    cache = KVCache.zeros(config, 1, 16)
    step = jax.jit(lambda c, t, i: forward(params, config, t, i[:, None], c, i), donate_argnums=0)
    for i, tok in enumerate(ids):
        out = step(cache, jnp.asarray([[tok]]), jnp.asarray([i]))
        cache = out.cache
        np.testing.assert_allclose(np.asarray(out.logits[0, 0]), full[i], atol=1e-4, rtol=1e-4)


def test_block_mask_can_express_a_tree(tiny_hf):
    """Two sibling branches verified in one forward equal each branch run alone."""
    _, _, folder = tiny_hf
    config, params = load_hf_model(folder)
    prefix, branch_a, branch_b = [5, 17, 3], [40, 41], [50, 51]
    cache = KVCache.zeros(config, 1, 16)
    pre = forward(params, config, jnp.asarray([prefix]), jnp.arange(3)[None], cache, jnp.zeros((1,), jnp.int32))
    # nodes: a0 a1 b0 b1; a1's ancestor is a0, b1's is b0
    mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)[None]
    tree = forward(params, config, jnp.asarray([branch_a + branch_b]), jnp.asarray([[3, 4, 3, 4]]), pre.cache,
                   jnp.asarray([3]), block_mask=jnp.asarray(mask))
    for branch, rows in ((branch_a, slice(0, 2)), (branch_b, slice(2, 4))):
        alone, _ = _specjax_logits(config, params, prefix + branch)
        np.testing.assert_allclose(np.asarray(tree.logits[0, rows]), alone[3:], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_and_untied_head(tmp_path):
    model = build_tiny_hf("llama", seed=3, tie_word_embeddings=False)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    config, params = load_hf_model(tmp_path)
    assert not config.tie_word_embeddings
    ids = PROMPTS[1]
    logits, _ = _specjax_logits(config, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)


def test_bf16_checkpoint_loads(tmp_path):
    model = build_tiny_hf("qwen3", seed=5)
    with torch.no_grad():  # the reference holds exactly the bf16 values, computed in float32
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    build_tiny_hf("qwen3", seed=5).to(torch.bfloat16).save_pretrained(tmp_path)
    config, params = load_hf_model(tmp_path)
    ids = PROMPTS[0]
    logits, _ = _specjax_logits(config, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)


def test_rope_and_defaults_from_config(tmp_path):
    from specjax.io.hf import config_from_hf

    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 8}
    cfg = config_from_hf({**base, "rope_scaling": {"rope_type": "default"}})
    assert cfg.rope_scaling is None and cfg.head_dim == 128 and cfg.max_position_embeddings == 32768
    llama3 = config_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
    assert llama3.rope_theta == 5e5 and llama3.rope_scaling.kind == "llama3"
    with pytest.raises(SpecjaxError, match="yarn"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(SpecjaxError, match="JSON object"):
        config_from_hf([1, 2])


def test_save_then_load_round_trips(tiny_hf, tmp_path):
    _, _, folder = tiny_hf
    config, params = load_hf_model(folder)
    save_hf_model(tmp_path, config, params)
    config2, params2 = load_hf_model(tmp_path)
    assert config2 == config
    chex.assert_trees_all_close(params2, params)


# ---- bad input ---------------------------------------------------------------------------------

@pytest.fixture()
def llama_copy(tmp_path):
    """A fresh tiny Llama folder that each error test may damage."""
    build_tiny_hf("llama").save_pretrained(tmp_path)
    return tmp_path


def test_unknown_architecture_is_refused(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecjaxError, match="GPT2LMHeadModel.*not supported"):
        load_hf_model(llama_copy)


def test_missing_weight_file(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(SpecjaxError, match="no \\*.safetensors"):
        load_hf_model(llama_copy)


def test_truncated_weight_file(llama_copy):
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SpecjaxError, match="truncated or corrupt"):
        load_hf_model(llama_copy)


def test_shape_mismatch_between_config_and_tensors(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecjaxError, match="mlp.*has shape .* but config.json implies"):
        load_hf_model(llama_copy)


def test_missing_tensor_is_named(llama_copy):
    from safetensors.numpy import load_file, save_file

    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(SpecjaxError, match="missing weights layers_1.mlp.up_proj.kernel"):
        load_hf_model(llama_copy)
