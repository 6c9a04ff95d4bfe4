"""GGUF files of Llama-architecture models: weights (dequantized with `gguf`) and tokenizer."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError
from specjax.io.hf import params_from_named_tensors
from specjax.io.tokenizer import TextTokenizer, byte_level_bpe_from_vocab
from specjax.models.config import TransformerConfig

KEEP_CONVERTED = 4
"""Converted GGUF models kept under $SPECJAX_CACHE/converted (about 4 bytes a parameter each)."""

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
    """(TransformerConfig, params, TextTokenizer) from a GGUF file. Weights are dequantized to float32.
    The result is kept converted under $SPECJAX_CACHE/converted (see `_converted_folder`): reading a
    GGUF's metadata and dequantizing it took 6-8 s of every start on the 2-core EPYC, loading the
    converted copy well under one."""
    path = Path(path)
    folder = _converted_folder(path)
    if folder is not None:
        kept = _load_converted(folder)
        if kept is not None:
            return kept
    reader = _open(path)
    config = gguf_config(reader, str(path))
    params = params_from_named_tensors(config, _hf_tensors(reader, config, str(path)), str(path))
    loaded = config, params, gguf_tokenizer(reader, str(path))
    if folder is not None:
        _save_converted(folder, *loaded)
    return loaded


def _converted_folder(path: Path) -> Path | None:
    """Where this GGUF's converted copy is kept: keyed by the file (its path, size and modification
    time), the gguf library's version and the source of the code that converts it, so any of them
    changing converts again. None when the file cannot be read (the reader then says why)."""
    import gguf

    from specjax.files import cache_root
    from specjax.io import hf, tokenizer

    try:
        stat = path.stat()
    except OSError:
        return None
    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (sys.modules[__name__], hf, tokenizer)))
    version = getattr(gguf, "__version__", "")
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version}|{code.hexdigest()}"
    return cache_root() / "converted" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _load_converted(folder: Path):
    """(config, params, tokenizer) kept by _save_converted, or None if absent or unreadable."""
    from flax import traverse_util

    try:
        with open(folder / "model.pkl", "rb") as f:
            config, tokenizer = pickle.load(f)
        with np.load(folder / "params.npz") as arrays:
            params = traverse_util.unflatten_dict({k: arrays[k] for k in arrays.files}, sep="/")
        os.utime(folder)  # most recently used
    except (OSError, ValueError, EOFError, pickle.UnpicklingError, AttributeError, KeyError):
        return None
    return config, params, tokenizer


def _save_converted(folder: Path, config, params, tokenizer) -> None:
    """Keep the converted model (about 4 bytes a parameter); written whole or not at all. A disk
    that cannot take it costs the next start its speed, not this one its model."""
    from flax import traverse_util

    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        np.savez(partial / "params.npz", **traverse_util.flatten_dict(params, sep="/"))
        with open(partial / "model.pkl", "wb") as f:
            pickle.dump((config, tokenizer), f)
        partial.rename(folder)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        return
    kept = sorted((p for p in folder.parent.iterdir() if p.is_dir() and "." not in p.name),
                  key=lambda p: p.stat().st_mtime)
    for old in kept[:-KEEP_CONVERTED]:  # the least recently used beyond the limit
        shutil.rmtree(old, ignore_errors=True)
