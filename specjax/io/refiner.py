"""Refiner checkpoints: a folder with config.json and model.safetensors.

config.json holds the RefinerConfig fields, `architectures: ["SpecjaxCausalRefiner"]` and the
fingerprint of the drafter the refiner was trained on (`drafter_fingerprint`); tensors are named by
their flax parameter paths joined with ".". Loading checks every name and shape.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from flax import traverse_util

from specjax.errors import SpecjaxError
from specjax.models.refiner import RefinerConfig, drafter_fingerprint, init_refiner_params

ARCHITECTURE = "SpecjaxCausalRefiner"


@dataclasses.dataclass
class LoadedRefiner:
    source: str
    config: RefinerConfig
    params: dict
    drafter_fingerprint: str | None
    """Fingerprint of the drafter it was trained on (models.refiner.drafter_fingerprint), if recorded."""


def save_refiner(folder: str | Path, config: RefinerConfig, params, fingerprint: str | None,
                 dtype: str = "float32", extra: dict | None = None) -> None:
    """Write a refiner (bf16 keeps committed checkpoints small). `extra` is stored under
    "training" in config.json (how it was trained)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, leaf in traverse_util.flatten_dict(params, sep=".").items():
        array = np.asarray(leaf, np.float32)
        tensors[name] = array.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else array
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = {"architectures": [ARCHITECTURE], **dataclasses.asdict(config), "drafter_fingerprint": fingerprint,
           "dtype": dtype}
    if extra:
        cfg["training"] = extra
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def load_refiner(folder: str | Path) -> LoadedRefiner:
    import jax
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from specjax.io.dflash import read_config_folder

    folder, cfg = read_config_folder(folder, "refiner")
    cfg_path = folder / "config.json"
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise SpecjaxError(f"{folder}: not a specjax refiner (architectures must include {ARCHITECTURE!r}; "
                           "a drafter folder goes to --drafter)")
    fields = {f.name for f in dataclasses.fields(RefinerConfig)}
    try:
        config = RefinerConfig(**{k: v for k, v in cfg.items() if k in fields})
    except TypeError as e:
        raise SpecjaxError(f"{cfg_path}: bad refiner config ({e})") from None
    weights = folder / "model.safetensors"
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise SpecjaxError(f"{weights}: cannot read refiner weights, the file may be missing, truncated or "
                           f"corrupt ({e})") from None
    expected = {".".join(p): tuple(l.shape) for p, l in traverse_util.flatten_dict(
        jax.eval_shape(lambda: init_refiner_params(config, jax.random.key(0)))).items()}
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SpecjaxError(f"{folder}: unexpected refiner tensor {unexpected[0]!r} for a {config.kind} refiner")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise SpecjaxError(f"{folder}: missing refiner weights {', '.join(missing[:5])}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise SpecjaxError(f"{folder}: tensor {name!r} has shape {tuple(tensors[name].shape)}, config implies {shape}")
    params = traverse_util.unflatten_dict({k: np.asarray(v, np.float32) for k, v in tensors.items()}, sep=".")
    return LoadedRefiner(str(folder), config, params, cfg.get("drafter_fingerprint"))


def check_refiner(refiner: LoadedRefiner, drafter) -> None:
    """Refuse a refiner that was not trained for this drafter (a LoadedDrafter), naming the mismatch."""
    if refiner.config.hidden_size != drafter.config.hidden_size:
        raise SpecjaxError(f"refiner width {refiner.config.hidden_size} != drafter hidden size "
                           f"{drafter.config.hidden_size}")
    if refiner.config.block_size != drafter.config.block_size:
        raise SpecjaxError(f"{refiner.source} refines blocks of {refiner.config.block_size}; the drafter "
                           f"{drafter.source} drafts blocks of {drafter.config.block_size}")
    if refiner.drafter_fingerprint is not None:
        actual = drafter_fingerprint(drafter.params, drafter.draft_vocab)
        if actual != refiner.drafter_fingerprint:
            raise SpecjaxError(f"{refiner.source} was trained for drafter {refiner.drafter_fingerprint}, but "
                               f"{drafter.source} is drafter {actual}; retrain the refiner for this drafter "
                               "(specjax train-refiner)")
