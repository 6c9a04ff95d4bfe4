"""Drafter checkpoints in DFlash's published HF format (config.json + model.safetensors).

config.json: `architectures: ["DFlashDraftModel"]`, the usual decoder keys (hidden_size,
num_hidden_layers, heads, head_dim, intermediate_size, rms_norm_eps, rope_theta, vocab_size),
top-level `block_size` and `num_target_layers`, and `dflash_config: {mask_token_id,
target_layer_ids}`. Tensors: `fc.weight` [d, taps·d], `hidden_norm.weight`, `norm.weight` and
`layers.{i}.…` named as in an HF Llama/Qwen3 layer; no embedding or LM head (the target's are
used). specjax writes its own drafters in the same format. For a target whose vocabulary has no
spare id it adds one tensor, `mask_embedding` [d], and sets mask_token_id to null. A drafter with
specjax's anchor path adds `anchor_proj.weight` [d, d] and `slot_embedding` [block, d], and
`dflash_config.anchor_path: true`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from flax import traverse_util

from specjax.errors import SpecjaxError
from specjax.models.config import TransformerConfig
from specjax.models.drafter import DrafterConfig

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_LEAVES = {
    "self_attn.q_proj.weight": (("q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("o_proj", "kernel"), True),
    "self_attn.q_norm.weight": (("q_norm", "scale"), False),
    "self_attn.k_norm.weight": (("k_norm", "scale"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
    "input_layernorm.weight": (("input_layernorm", "scale"), False),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), False),
}
_TOP = {
    "fc.weight": (("fc", "kernel"), True),
    "hidden_norm.weight": (("hidden_norm", "scale"), False),
    "norm.weight": (("norm", "scale"), False),
    "mask_embedding": (("mask_embedding",), False),
    # specjax's anchor path (DrafterConfig.anchor_path); absent from DFlash's own checkpoints.
    "anchor_proj.weight": (("anchor_proj", "kernel"), True),
    "slot_embedding": (("slot_embedding",), False),
}


def _to_flax(name: str):
    if name in _TOP:
        return _TOP[name]
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_LEAVES:
        path, transpose = _LAYER_LEAVES[match.group(2)]
        return (f"layers_{match.group(1)}",) + path, transpose
    return None


@dataclasses.dataclass
class LoadedDrafter:
    source: str
    config: DrafterConfig
    params: dict
    num_target_layers: int | None
    """Depth of the target the drafter was trained for (DFlash's `num_target_layers`)."""
    draft_vocab: np.ndarray | None = None
    """[V'] int32 token ids the drafter's head covers, or None for the whole vocabulary."""


def drafter_config_from_json(cfg: dict, source: str, has_qk_norm: bool) -> tuple[DrafterConfig, int | None]:
    try:
        dflash = cfg.get("dflash_config") or {}
        rope = cfg.get("rope_parameters") or {}
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        block = cfg.get("block_size", dflash.get("block_size"))
        if block is None:
            raise KeyError("block_size")
        config = DrafterConfig(
            hidden_size=hidden,
            vocab_size=int(cfg["vocab_size"]),
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            block_size=int(block),
            mask_token_id=None if dflash.get("mask_token_id") is None else int(dflash["mask_token_id"]),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qk_norm=has_qk_norm,
            anchor_path=bool(dflash.get("anchor_path", False)),
        )
    except KeyError as e:
        raise SpecjaxError(f"{source}: not a DFlash drafter config, key {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise SpecjaxError(f"{source}: bad drafter config ({e})") from None
    if any(t == "sliding_attention" for t in cfg.get("layer_types") or []):
        raise SpecjaxError(f"{source}: sliding-window drafter layers are not supported yet")
    num_target = cfg.get("num_target_layers")
    return config, None if num_target is None else int(num_target)


def read_config_folder(folder: str | Path, what: str) -> tuple[Path, dict]:
    """(folder, its parsed config.json) for a checkpoint folder, or a SpecjaxError naming `what`."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not folder.is_dir() or not cfg_path.exists():
        raise SpecjaxError(f"{folder}: not a {what} folder (config.json missing)")
    try:
        return folder, json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SpecjaxError(f"{cfg_path}: invalid JSON ({e})") from None


def load_drafter(folder: str | Path) -> LoadedDrafter:
    """Read a DFlash-format drafter folder, checking every tensor name and shape."""
    import jax
    from safetensors import SafetensorError
    from safetensors.flax import load_file

    from specjax.models.drafter import init_drafter_params

    folder, cfg = read_config_folder(folder, "drafter")
    cfg_path = folder / "config.json"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecjaxError(f"{folder}: no *.safetensors weight file found")
    tensors = {}
    for path in files:
        try:
            tensors.update({k: np.asarray(v, np.int32 if k == "draft_vocab" else np.float32)
                            for k, v in load_file(str(path)).items()})
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise SpecjaxError(f"{path}: cannot read drafter weights, the file may be truncated or corrupt ({e})") from None
    config, num_target = drafter_config_from_json(cfg, str(cfg_path), any("q_norm" in k for k in tensors))
    expected = {p: tuple(l.shape) for p, l in traverse_util.flatten_dict(
        jax.eval_shape(lambda: init_drafter_params(config, jax.random.key(0)))).items()}
    flat = {}
    draft_vocab = tensors.pop("draft_vocab", None)
    if draft_vocab is not None:
        draft_vocab = draft_vocab.astype(np.int32)
        if draft_vocab.ndim != 1 or draft_vocab.min() < 0 or draft_vocab.max() >= config.vocab_size:
            raise SpecjaxError(f"{folder}: draft_vocab must be a list of token ids below {config.vocab_size}")
    for name, array in tensors.items():
        mapped = _to_flax(name)
        if mapped is None:
            if name in ("embed_tokens.weight", "lm_head.weight"):
                continue  # some exports carry a copy of the target's; the target's own are used
            raise SpecjaxError(f"{folder}: unexpected drafter tensor {name!r}")
        path, transpose = mapped
        array = array.T if transpose else array
        if path not in expected:
            raise SpecjaxError(f"{folder}: tensor {name!r} does not fit this config (mask_token_id, qk-norm, anchor path or depth)")
        if tuple(array.shape) != expected[path]:
            raise SpecjaxError(f"{folder}: tensor {name!r} has shape {array.T.shape if transpose else array.shape}, "
                               f"config implies {expected[path][::-1] if transpose else expected[path]}")
        flat[path] = np.ascontiguousarray(array)
    missing = sorted(".".join(p) for p in expected if p not in flat)
    if missing:
        raise SpecjaxError(f"{folder}: missing drafter weights {', '.join(missing[:5])}")
    return LoadedDrafter(str(folder), config, traverse_util.unflatten_dict(flat), num_target, draft_vocab)


def save_drafter(folder: str | Path, config: DrafterConfig, params, target: TransformerConfig,
                 dtype=np.float32, draft_vocab: np.ndarray | None = None) -> None:
    """Write a drafter in DFlash's format (bf16 keeps committed checkpoints small). A restricted
    draft vocabulary is stored as an extra int32 tensor `draft_vocab`."""
    import ml_dtypes
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    inverse = {path: (name, t) for name, (path, t) in _TOP.items()}
    tensors = {}
    for path, leaf in traverse_util.flatten_dict(params).items():
        if path in inverse:
            name, transpose = inverse[path]
        else:
            (leaf_name, transpose), = [(k, t) for k, (p, t) in _LAYER_LEAVES.items() if p == path[1:]]
            name = f"layers.{path[0].split('_')[1]}.{leaf_name}"
        array = np.asarray(leaf, np.float32)
        array = np.ascontiguousarray(array.T if transpose else array)
        tensors[name] = array.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else array.astype(dtype)
    if draft_vocab is not None:
        tensors["draft_vocab"] = np.asarray(draft_vocab, np.int32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3" if config.qk_norm else "llama",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": config.block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                          **({"anchor_path": True} if config.anchor_path else {})},
        "layer_types": ["full_attention"] * config.num_layers,
        "sliding_window": None,
        "dtype": "bfloat16" if dtype == "bfloat16" else "float32",
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def check_pair(drafter: LoadedDrafter, target: TransformerConfig, block_size: int | None = None) -> None:
    """Refuse a drafter/target pair or block size that cannot work, naming the mismatch."""
    drafter.config.check_target(target)
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_layers:
        raise SpecjaxError(f"{drafter.source} was trained for a target with {drafter.num_target_layers} layers; "
                           f"this target has {target.num_layers}")
    if block_size is not None and block_size != drafter.config.block_size:
        raise SpecjaxError(f"{drafter.source} was trained with block size {drafter.config.block_size}, "
                           f"not {block_size}")
