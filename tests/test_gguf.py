"""GGUF loading: a tiny Llama written as GGUF (llama.cpp's Q/K permutation, every supported tensor
type) must give the same logits as the HF model holding the same (de)quantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specjax.errors import SpecjaxError
from specjax.io.gguf import _unpermute_rope, load_gguf_model
from specjax.io.tokenizer import bytes_to_unicode
from specjax.models.cache import KVCache
from specjax.models.transformer import forward

from conftest import build_tiny_hf

gguf = pytest.importorskip("gguf")

TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script: rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(size: int):
    alphabet = list(bytes_to_unicode().values())
    specials = ["<|im_start|>", "<|im_end|>"]
    newline = bytes_to_unicode()[ord("\n")]
    tokens = alphabet[: size - len(specials) - 3] + [newline, "ab", "abc"] + specials
    types = [1] * (size - 2) + [3, 3]
    return tokens, types, ["a b", "ab c"]


def write_tiny_gguf(path, model, qtype_for):
    """Write model as GGUF; qtype_for(hf_name) picks each matrix's tensor type. Returns the HF
    state dict holding exactly the values the GGUF file decodes to."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    tokens, types, merges = _vocab(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(cfg.vocab_size - 1)
    writer.add_bos_token_id(cfg.vocab_size - 2)
    writer.add_chat_template(TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    decoded = {}
    for name, tensor in model.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if name in names:
            gname = names[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{per_layer['.'.join(parts[3:-1])]}.weight"
        if name.endswith("q_proj.weight"):
            w_file = _permute(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w_file = _permute(w, cfg.num_key_value_heads)
        else:
            w_file = w
        qtype = gguf.GGMLQuantizationType.F32 if w.ndim == 1 else qtype_for(name)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = w_file.astype(np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32)
            writer.add_tensor(gname, data)
            back = data.astype(np.float32)
        else:
            data = gguf.quants.quantize(w_file, qtype)
            writer.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype).reshape(w_file.shape)
        # Undo the permutation to get what HF should hold.
        if name.endswith("q_proj.weight"):
            back = _unpermute_rope(back, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            back = _unpermute_rope(back, cfg.num_key_value_heads)
        decoded[name] = torch.from_numpy(np.ascontiguousarray(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_logits_match_hf_with_same_weights(tmp_path, qtype):
    model = build_tiny_hf("llama", seed=1, tie_word_embeddings=False)
    chosen = getattr(gguf.GGMLQuantizationType, qtype)
    decoded = write_tiny_gguf(tmp_path / "tiny.gguf", model, lambda name: chosen)
    model.load_state_dict(decoded)
    config, params, tokenizer = load_gguf_model(tmp_path / "tiny.gguf")
    assert config.num_layers == 2 and config.num_kv_heads == 2 and not config.tie_word_embeddings
    ids = [5, 17, 3, 60, 42, 9, 1, 70]
    out = forward(params, config, np.asarray([ids]), np.arange(len(ids))[None], KVCache.zeros(config, 1, 16),
                  np.zeros((1,), np.int32))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref, atol=1e-4, rtol=1e-4)


def test_gguf_tokenizer_and_chat_template(tmp_path):
    model = build_tiny_hf("llama", seed=2)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, lambda name: gguf.GGMLQuantizationType.F32)
    _, _, tok = load_gguf_model(tmp_path / "tiny.gguf")
    start, end = tok.backend.token_to_id("<|im_start|>"), tok.backend.token_to_id("<|im_end|>")
    ids = tok.encode_chat("abc")
    assert ids[0] == start and end in ids
    assert tok.backend.token_to_id("abc") in ids  # merges from the metadata are applied
    assert tok.eos_token_ids == (end,)
    assert tok.decode(ids) == "user\nabc\nassistant\n"


def test_truncated_gguf_is_a_clear_error(tmp_path):
    model = build_tiny_hf("llama", seed=1)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, lambda name: gguf.GGMLQuantizationType.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(SpecjaxError, match="truncated"):
        load_gguf_model(path)


def test_a_converted_gguf_is_kept_and_loads_the_same(tmp_path, monkeypatch):
    """The second load of a GGUF reads the converted copy (not the file) and gives the same config,
    weights and tokenizer; a damaged copy is converted again; a changed file is a new copy; at most
    KEEP_CONVERTED copies are kept."""
    from specjax.io import gguf as gguf_io

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, build_tiny_hf("llama", seed=3), lambda name: gguf.GGMLQuantizationType.Q8_0)
    config, params, tokenizer = load_gguf_model(path)
    [kept] = (tmp_path / "cache" / "converted").iterdir()

    def unreadable(*args):
        raise AssertionError("the GGUF was read again")

    with monkeypatch.context() as patched:
        patched.setattr(gguf_io, "_open", unreadable)
        again, params_again, tokenizer_again = load_gguf_model(path)
    assert again == config and tokenizer_again.encode_chat("abc") == tokenizer.encode_chat("abc")
    from flax.traverse_util import flatten_dict

    weights, weights_again = flatten_dict(params, sep="/"), flatten_dict(params_again, sep="/")
    assert weights.keys() == weights_again.keys()
    assert all(np.array_equal(weights[k], weights_again[k]) for k in weights)
    (kept / "params.npz").write_bytes(b"damaged")
    assert np.array_equal(load_gguf_model(path)[1]["embed_tokens"]["embedding"], params["embed_tokens"]["embedding"])
    for seed in range(gguf_io.KEEP_CONVERTED + 1):  # other files: new copies, the oldest dropped
        write_tiny_gguf(tmp_path / f"other{seed}.gguf", build_tiny_hf("llama", seed=seed + 10),
                        lambda name: gguf.GGMLQuantizationType.F32)
        load_gguf_model(tmp_path / f"other{seed}.gguf")
    assert len(list((tmp_path / "cache" / "converted").iterdir())) == gguf_io.KEEP_CONVERTED
