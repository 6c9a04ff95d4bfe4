"""Refiner checkpoints: a folder with config.json and model.safetensors.

config.json holds the RefinerConfig fields, `architectures: ["SpecjaxCausalRefiner"]` and the
fingerprint of the drafter the refiner was trained on (`drafter_fingerprint`); tensors are named by
their flax parameter paths joined with ".". Loading checks every name and shape.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flax import traverse_util

from specjax.errors import SpecjaxError
from specjax.io.addons import params_from_tensors, read_addon_tensors, save_addon
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
    cfg = {"architectures": [ARCHITECTURE], **dataclasses.asdict(config), "drafter_fingerprint": fingerprint}
    if extra:
        cfg["training"] = extra
    save_addon(folder, params, cfg, dtype)

def load_refiner(folder: str | Path) -> LoadedRefiner:
    import jax

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
    tensors = read_addon_tensors(folder, "refiner")
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
    params = params_from_tensors(tensors)
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
