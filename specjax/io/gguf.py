"""GGUF files of Llama-architecture models: weights (dequantized with `gguf`) and tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError
from specjax.io.hf import params_from_named_tensors
from specjax.io.tokenizer import TextTokenizer, byte_level_bpe_from_vocab
from specjax.models.config import TransformerConfig

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _open(path: Path):
    import gguf

    if not path.exists():
        raise SpecjaxError(f"{path}: file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueErrors / struct errors on bad files
        raise SpecjaxError(f"{path}: not a readable GGUF file, it may be truncated or corrupt ({e})") from None


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, source: str) -> TransformerConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SpecjaxError(f"{source}: GGUF architecture {arch!r} is not supported (only llama)")
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none") or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise SpecjaxError(f"{source}: RoPE frequency scaling in GGUF files is not supported yet; "
                           "load the model's HF folder instead")
    try:
        num_heads = int(_field(reader, "llama.attention.head_count"))
        hidden = int(_field(reader, "llama.embedding_length"))
        tokens = reader.fields["tokenizer.ggml.tokens"]
        has_head = any(t.name == "output.weight" for t in reader.tensors)
        return TransformerConfig(
            vocab_size=int(_field(reader, "llama.vocab_size", len(tokens.data))),
            hidden_size=hidden,
            num_layers=int(_field(reader, "llama.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
            head_dim=int(_field(reader, "llama.attention.key_length",
                                _field(reader, "llama.rope.dimension_count", hidden // num_heads))),
            intermediate_size=int(_field(reader, "llama.feed_forward_length")),
            rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=not has_head,
            max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
            architecture="LlamaForCausalLM",
        )
    except (KeyError, TypeError) as e:
        raise SpecjaxError(f"{source}: GGUF metadata is incomplete ({e})") from None


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved-pair RoPE) to get HF's rotate-half rows."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(reader, config: TransformerConfig, source: str):
    import gguf

    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise SpecjaxError(f"{source}: tensor {tensor.name} uses {kind}; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
        if tensor.name in _GGUF_TO_HF:
            name = _GGUF_TO_HF[tensor.name]
        else:
            parts = tensor.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER_TO_HF:
                raise SpecjaxError(f"{source}: unexpected tensor {tensor.name!r}")
            name = f"model.layers.{parts[1]}.{_GGUF_LAYER_TO_HF[parts[2]]}.{parts[3]}"
        try:
            array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except Exception as e:
            raise SpecjaxError(f"{source}: cannot read tensor {tensor.name} ({e}); the file may be truncated") from None
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if name.endswith("q_proj.weight"):
            array = _unpermute_rope(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rope(array, config.num_kv_heads)
        yield name, array


def gguf_tokenizer(reader, source: str) -> TextTokenizer:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise SpecjaxError(f"{source}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = _field(reader, "tokenizer.ggml.token_type")
    backend = byte_level_bpe_from_vocab(
        tokens, list(_field(reader, "tokenizer.ggml.merges", [])), list(types) if types is not None else None,
        _field(reader, "tokenizer.ggml.pre"),
    )
    bos_id, eos_id = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    return TextTokenizer(
        backend=backend,
        chat_template=_field(reader, "tokenizer.chat_template"),
        eos_token_ids=(int(eos_id),) if eos_id is not None else (),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        bos_token_id=int(bos_id) if bos_id is not None else None,
    )


def load_gguf_model(path: str | Path):
    """(TransformerConfig, params, TextTokenizer) from a GGUF file. Weights are dequantized to float32."""
    path = Path(path)
    reader = _open(path)
    config = gguf_config(reader, str(path))
    params = params_from_named_tensors(config, _hf_tensors(reader, config, str(path)), str(path))
    return config, params, gguf_tokenizer(reader, str(path))
