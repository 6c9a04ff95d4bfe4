"""HF checkpoints: `config.json` + `*.safetensors` (single file or sharded index) for Llama, Mistral,
Qwen3 and the Gemma 1/2/3 text models.

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
from specjax.models.config import (ACTIVATIONS, GEMMA_ARCHITECTURES, MODEL_TYPES, SUPPORTED_ARCHITECTURES, RopeScaling,
                                   TransformerConfig)
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
    "pre_feedforward_layernorm.weight": (("pre_feedforward_layernorm", "scale"), False),
    "post_feedforward_layernorm.weight": (("post_feedforward_layernorm", "scale"), False),
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
    if arch == "GemmaForCausalLM":
        return None, ()
    if arch in GEMMA_ARCHITECTURES:  # Gemma 2 alternates sliding/full; Gemma 3 has 5 sliding per full layer
        window = hf.get("sliding_window", 4096)
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern") or 6)
        default_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    else:
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        first = int(hf.get("max_window_layers", 28))
        default_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    layer_types = hf.get("layer_types") or default_types
    if window is None:
        if "sliding_attention" in layer_types and arch in GEMMA_ARCHITECTURES:
            raise SpecjaxError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")
        return None, ()
    layer_types = tuple(str(t) for t in layer_types)
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise SpecjaxError(f"{source}: layer type {unknown[0]!r} is not supported (full_attention, sliding_attention)")
    if len(layer_types) != num_layers:
        raise SpecjaxError(f"{source}: layer_types names {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    if "sliding_attention" not in layer_types:
        return None, ()
    return int(window), layer_types


def _rope_scaling(scaling: Mapping[str, Any] | None, source: str) -> RopeScaling | None:
    """RopeScaling from an HF rope_scaling / rope_parameters dict (None for the default RoPE)."""
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("linear", "llama3"):
        raise SpecjaxError(f"{source}: rope scaling {kind!r} is not supported (linear, llama3)")
    return RopeScaling(
        kind=kind,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _rope(hf: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling and (Gemma 3) local_rope_theta, from either config layout:
    transformers 5 folds them into rope_parameters (per layer type for Gemma 3); older files have
    rope_theta, rope_scaling and rope_local_base_freq."""
    rope = dict(hf.get("rope_parameters") or {})
    if arch == "Gemma3ForCausalLM":
        full = dict(rope.get("full_attention") or {})
        local = dict(rope.get("sliding_attention") or {})
        full_scaling = full or hf.get("rope_scaling")
        local_scaling = _rope_scaling(local, source)
        if local_scaling is not None:
            raise SpecjaxError(f"{source}: rope scaling on the sliding layers is not supported")
        return dict(rope_theta=float(full.get("rope_theta", hf.get("rope_theta") or 1_000_000.0)),
                    rope_scaling=_rope_scaling(full_scaling, source),
                    local_rope_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq") or 10_000.0)))
    return dict(rope_theta=float(rope.get("rope_theta", hf.get("rope_theta") or 10000.0)),
                rope_scaling=_rope_scaling(hf.get("rope_scaling") or rope, source))


def _gemma_fields(hf: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The TransformerConfig fields in which Gemma 1/2/3 differ from Llama (defaults as transformers'
    config classes have them)."""
    if arch not in GEMMA_ARCHITECTURES:
        return dict(hidden_act=hf.get("hidden_act") or "silu", qk_norm=arch == "Qwen3ForCausalLM")
    if hf.get("use_bidirectional_attention"):
        raise SpecjaxError(f"{source}: use_bidirectional_attention (an encoder) is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if arch == "GemmaForCausalLM" and act == "gelu":  # transformers reads Gemma 1's legacy "gelu" as tanh-GELU
        act = "gelu_pytorch_tanh"
    fields = dict(hidden_act=act, norm_unit_offset=True, scale_embeddings=True,
                  qk_norm=arch == "Gemma3ForCausalLM")
    if arch != "GemmaForCausalLM":
        caps = (30.0, 50.0) if arch == "Gemma2ForCausalLM" else (None, None)
        final_cap = hf["final_logit_softcapping"] if "final_logit_softcapping" in hf else caps[0]
        attn_cap = hf["attn_logit_softcapping"] if "attn_logit_softcapping" in hf else caps[1]
        fields.update(sandwich_norms=True, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
                      final_logit_softcapping=None if final_cap is None else float(final_cap),
                      attn_logit_softcapping=None if attn_cap is None else float(attn_cap))
    return fields


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> TransformerConfig:
    """TransformerConfig from an HF config dict; unknown architectures are refused by name."""
    if not isinstance(hf, Mapping):
        raise SpecjaxError(f"{source}: expected a JSON object")
    archs = hf.get("architectures") or []
    by_model_type = {model_type: name for name, model_type in MODEL_TYPES.items()}
    arch = archs[0] if archs else by_model_type.get(hf.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        hint = ""
        if arch == "Gemma3ForConditionalGeneration":
            hint = " (the multimodal Gemma 3; its text-only sizes load as Gemma3ForCausalLM)"
        raise SpecjaxError(
            f"{source}: architecture {arch or hf.get('model_type')!r} is not supported{hint}; "
            f"specjax loads {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gemma = arch in GEMMA_ARCHITECTURES
    try:
        fields = _gemma_fields(hf, arch, source)
        if fields["hidden_act"] not in ACTIVATIONS or (fields["hidden_act"] != "silu" and not gemma):
            raise SpecjaxError(f"{source}: hidden_act {fields['hidden_act']!r} is not supported for {arch}")
        sliding_window, layer_types = _sliding_layers(hf, arch, int(hf["num_hidden_layers"]), source)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        # Qwen3's and Gemma's config classes default head_dim to 128 and 256 rather than hidden / heads.
        default_head_dim = {"Qwen3ForCausalLM": 128}.get(arch, 256 if gemma else hidden // num_heads)
        default_max_positions = {"Qwen3ForCausalLM": 32768, "Gemma3ForCausalLM": 131072}.get(
            arch, 8192 if gemma else 2048)
        return TransformerConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or default_head_dim),
            intermediate_size=int(hf["intermediate_size"]),
            **_rope(hf, arch, source),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            max_position_embeddings=int(hf.get("max_position_embeddings", default_max_positions)),
            architecture=arch,
            sliding_window=sliding_window,
            layer_types=layer_types,
            **fields,
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
