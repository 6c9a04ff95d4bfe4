"""Shared format of specjax's add-on checkpoints (refiners, segment compressors): a folder with
config.json and model.safetensors, tensors named by their flax parameter paths joined with "."."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import traverse_util

from specjax.errors import SpecjaxError


def save_addon(folder: str | Path, params, config: dict, dtype: str = "float32") -> None:
    """Write params (bf16 with dtype="bfloat16": committed checkpoints stay small) and config.json."""
    import ml_dtypes
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, leaf in traverse_util.flatten_dict(params, sep=".").items():
        array = np.asarray(leaf, np.float32)
        tensors[name] = array.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else array
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2))


def read_addon_tensors(folder: Path, what: str) -> dict:
    """The tensors of folder/model.safetensors, or a SpecjaxError naming `what` and the likely cause."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    weights = folder / "model.safetensors"
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise SpecjaxError(f"{weights}: cannot read {what} weights, the file may be missing, truncated or "
                           f"corrupt ({e})") from None


def params_from_tensors(tensors: dict) -> dict:
    return traverse_util.unflatten_dict({k: np.asarray(v, np.float32) for k, v in tensors.items()}, sep=".")
