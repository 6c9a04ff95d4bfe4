"""HF checkpoints: `config.json` + `*.safetensors` (single file or sharded index) for Llama and Qwen3.

The same name mapping serves GGUF (which is translated to HF names first) and saving.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from flax import traverse_util

from specjax.errors import SpecjaxError
from specjax.models.config import SUPPORTED_ARCHITECTURES, RopeScaling, TransformerConfig
from specjax.models.transformer import init_params

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF leaf name inside a layer -> (flax path inside layers_i, is a Linear weight that needs a transpose)
_LAYER_LEAVES = {
    "self_attn.q_proj.weight": (("self_attn", "q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("self_attn", "k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("self_attn", "v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("self_attn", "o_proj", "kernel"), True),
    "self_attn.q_proj.bias": (("self_attn", "q_proj", "bias"), False),
    "self_attn.k_proj.bias": (("self_attn", "k_proj", "bias"), False),
    "self_attn.v_proj.bias": (("self_attn", "v_proj", "bias"), False),
    "self_attn.o_proj.bias": (("self_attn", "o_proj", "bias"), False),
    "self_attn.q_norm.weight": (("self_attn", "q_norm", "scale"), False),
    "self_attn.k_norm.weight": (("self_attn", "k_norm", "scale"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
    "mlp.gate_proj.bias": (("mlp", "gate_proj", "bias"), False),
    "mlp.up_proj.bias": (("mlp", "up_proj", "bias"), False),
    "mlp.down_proj.bias": (("mlp", "down_proj", "bias"), False),
    "input_layernorm.weight": (("input_layernorm", "scale"), False),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), False),
}
_TOP_LEAVES = {
    "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
    "model.norm.weight": (("norm", "scale"), False),
    "lm_head.weight": (("lm_head", "kernel"), True),
}


def hf_name_to_flax(name: str) -> tuple[tuple[str, ...], bool] | None:
    """(flax param path, needs transpose) for an HF tensor name, or None if it is not a model weight."""
    if name in _TOP_LEAVES:
        return _TOP_LEAVES[name]
    match = _LAYER_RE.match(name)
    if match and match.group(2) in _LAYER_LEAVES:
        path, transpose = _LAYER_LEAVES[match.group(2)]
        return (f"layers_{match.group(1)}",) + path, transpose
    return None


def _sliding_layers(hf: Mapping[str, Any], arch: str, num_layers: int, source: str):
    """(sliding_window, layer_types) as transformers reads them for this architecture.

    Llama has no sliding layers. Mistral slides in every layer unless sliding_window is null (its
    config class defaults it to 4096 and ignores layer_types). Qwen3 slides only with
    use_sliding_window, and then in the layers `layer_types` names (by default those from
    max_window_layers on), so full and sliding layers can alternate as in Gemma-style models."""
    if arch == "LlamaForCausalLM":
        return None, ()
    if arch == "MistralForCausalLM":
        window = hf.get("sliding_window", 4096)
        return (None if window is None else int(window)), ()
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if window is None:
        return None, ()
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = int(hf.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    layer_types = tuple(str(t) for t in layer_types)
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise SpecjaxError(f"{source}: layer type {unknown[0]!r} is not supported (full_attention, sliding_attention)")
    if len(layer_types) != num_layers:
        raise SpecjaxError(f"{source}: layer_types names {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    if "sliding_attention" not in layer_types:
        return None, ()
    return int(window), layer_types


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> TransformerConfig:
    """TransformerConfig from an HF config dict; unknown architectures are refused by name."""
    if not isinstance(hf, Mapping):
        raise SpecjaxError(f"{source}: expected a JSON object")
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                   "mistral": "MistralForCausalLM"}.get(hf.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecjaxError(
            f"{source}: architecture {arch or hf.get('model_type')!r} is not supported; "
            f"specjax loads {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise SpecjaxError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    try:
        sliding_window, layer_types = _sliding_layers(hf, arch, int(hf["num_hidden_layers"]), source)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or rope
        rope_scaling = None
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("linear", "llama3"):
                raise SpecjaxError(f"{source}: rope scaling {kind!r} is not supported (linear, llama3)")
            rope_scaling = RopeScaling(
                kind=kind,
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
            )
        return TransformerConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            # Qwen3's config class defaults head_dim to 128 rather than hidden / heads.
            head_dim=int(hf.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // num_heads)),
            intermediate_size=int(hf["intermediate_size"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=arch == "Qwen3ForCausalLM",
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings",
                                               32768 if arch == "Qwen3ForCausalLM" else 2048)),
            architecture=arch,
            sliding_window=sliding_window,
            layer_types=layer_types,
        )
    except KeyError as e:
        raise SpecjaxError(f"{source}: required key {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, SpecjaxError):
            raise
        raise SpecjaxError(f"{source}: {e}") from None


def expected_param_shapes(config: TransformerConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes).items()}


def params_from_named_tensors(
    config: TransformerConfig, tensors: Iterable[tuple[str, np.ndarray]], source: str, dtype=np.float32
):
    """Build the flax params tree from (HF name, array) pairs, checking every name and shape."""
    expected = expected_param_shapes(config)
    flat: dict[tuple[str, ...], np.ndarray] = {}
    for name, array in tensors:
        mapped = hf_name_to_flax(name)
        if mapped is None:
            if "rotary_emb" in name:  # some exports store inv_freq buffers; RoPE is recomputed
                continue
            raise SpecjaxError(f"{source}: unexpected tensor {name!r} for {config.architecture}")
        path, transpose = mapped
        if path not in expected:
            if path[-1] == "kernel" and path[0] == "lm_head" and config.tie_word_embeddings:
                continue  # tied models may still ship a copy of the head
            raise SpecjaxError(f"{source}: tensor {name!r} does not belong to a model with this config.json")
        array = np.asarray(array)
        if transpose:
            array = array.T
        if tuple(array.shape) != expected[path]:
            want = expected[path][::-1] if transpose else expected[path]
            raise SpecjaxError(
                f"{source}: tensor {name!r} has shape {tuple(np.asarray(array.T if transpose else array).shape)} "
                f"but config.json implies {want}"
            )
        flat[path] = np.ascontiguousarray(array, dtype=dtype)
    missing = sorted(".".join(p) for p in expected if p not in flat)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SpecjaxError(f"{source}: missing weights {shown}")
    return traverse_util.unflatten_dict(flat)


def params_to_named_tensors(params) -> dict[str, np.ndarray]:
    """Inverse of params_from_named_tensors: HF names -> numpy arrays in HF layout."""
    inverse = {}
    for name, (path, transpose) in _TOP_LEAVES.items():
        inverse[path] = (name, transpose)
    out = {}
    for path, leaf in traverse_util.flatten_dict(params).items():
        if path in inverse:
            name, transpose = inverse[path]
        else:
            layer = int(path[0].split("_")[1])
            (leaf_name, transpose), = [(k, t) for k, (p, t) in _LAYER_LEAVES.items() if p == path[1:]]
            name = f"model.layers.{layer}.{leaf_name}"
        array = np.asarray(leaf)
        out[name] = np.ascontiguousarray(array.T if transpose else array)
    return out


def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise SpecjaxError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({folder / f for f in weight_map.values()})
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise SpecjaxError(f"{index} lists shards that are missing: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecjaxError(f"{folder}: no *.safetensors weight file found")
    return files


def _iter_safetensors(files: list[Path]):
    from safetensors import SafetensorError
    from safetensors.flax import load_file  # numpy has no bfloat16; most real checkpoints are bf16

    for path in files:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise SpecjaxError(f"{path}: cannot read safetensors file, it may be truncated or corrupt ({e})") from None
        yield from ((name, np.asarray(array, dtype=np.float32)) for name, array in tensors.items())


def load_hf_config(folder: str | Path) -> TransformerConfig:
    folder = Path(folder)
    path = folder / "config.json"
    if not path.exists():
        raise SpecjaxError(f"{folder}: no config.json (expected an HF model folder)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecjaxError(f"{path}: invalid JSON ({e})") from None
    return config_from_hf(hf, str(path))


def load_hf_model(folder: str | Path):
    """(TransformerConfig, params) from an HF folder. Weights are converted to float32."""
    folder = Path(folder)
    config = load_hf_config(folder)
    params = params_from_named_tensors(config, _iter_safetensors(_safetensor_files(folder)), str(folder))
    return config, params


def save_hf_model(folder: str | Path, config: TransformerConfig, params, dtype=np.float32) -> None:
    """Write config.json + model.safetensors (HF layout), e.g. for a model trained with specjax."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(dtype) for k, v in params_to_named_tensors(params).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))


def eos_ids_from_hf(folder: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, falling back to config.json."""
    folder = Path(folder)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            try:
                eos = json.loads(path.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError) as e:
                raise SpecjaxError(f"{path}: invalid JSON ({e})") from None
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
