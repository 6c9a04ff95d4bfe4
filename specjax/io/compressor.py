"""Segment-compressor checkpoints (windowed drafting): a folder with config.json and model.safetensors.

config.json holds `architectures: ["SpecjaxSegmentCompressor"]`, the DrafterWindow it was trained
with (window, segment, summaries), the drafter width, and the fingerprint of the drafter it was
trained for. Tensors are named by their flax parameter paths joined with ".".
`windowed_drafter` turns a loaded drafter plus a compressor into a windowed drafter.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from flax import traverse_util

from specjax.errors import SpecjaxError
from specjax.models.drafter import DrafterWindow

ARCHITECTURE = "SpecjaxSegmentCompressor"


@dataclasses.dataclass
class LoadedCompressor:
    source: str
    window: DrafterWindow
    """The window it was trained with; `window.window` may be changed at decode time."""
    hidden_size: int
    params: dict
    drafter_fingerprint: str | None


def save_compressor(folder: str | Path, window: DrafterWindow, hidden_size: int, params, fingerprint: str | None,
                    dtype: str = "float32", extra: dict | None = None) -> None:
    """Write a compressor (bf16 keeps committed checkpoints small). `extra` goes under "training"."""
    import ml_dtypes
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, leaf in traverse_util.flatten_dict(params, sep=".").items():
        array = np.asarray(leaf, np.float32)
        tensors[name] = array.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else array
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = {"architectures": [ARCHITECTURE], **dataclasses.asdict(window), "hidden_size": hidden_size,
           "drafter_fingerprint": fingerprint, "dtype": dtype}
    if extra:
        cfg["training"] = extra
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def load_compressor(folder: str | Path) -> LoadedCompressor:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from specjax.io.dflash import read_config_folder

    folder, cfg = read_config_folder(folder, "compressor")
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise SpecjaxError(f"{folder}: not a specjax segment compressor (architectures must include {ARCHITECTURE!r})")
    try:
        window = DrafterWindow(window=int(cfg["window"]), segment=int(cfg["segment"]), summaries=int(cfg["summaries"]))
        hidden = int(cfg["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise SpecjaxError(f"{folder / 'config.json'}: bad compressor config ({e})") from None
    weights = folder / "model.safetensors"
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise SpecjaxError(f"{weights}: cannot read compressor weights, the file may be missing, truncated or "
                           f"corrupt ({e})") from None
    expected = {"queries": (window.summaries, hidden), "key_proj.kernel": (hidden, hidden),
                "out_proj.kernel": (hidden, hidden)}
    for name, shape in expected.items():
        if name not in tensors:
            raise SpecjaxError(f"{folder}: missing compressor weight {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise SpecjaxError(f"{folder}: tensor {name!r} has shape {tuple(tensors[name].shape)}, config implies {shape}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SpecjaxError(f"{folder}: unexpected compressor tensor {unexpected[0]!r}")
    params = traverse_util.unflatten_dict({k: np.asarray(v, np.float32) for k, v in tensors.items()}, sep=".")
    return LoadedCompressor(str(folder), window, hidden, params, cfg.get("drafter_fingerprint"))


def windowed_drafter(drafter, compressor: LoadedCompressor, window: int | None = None):
    """A copy of `drafter` (a LoadedDrafter) that drafts with a sliding window of `window` raw
    context positions (default: the compressor's) plus the compressor's summary tokens."""
    from specjax.models.refiner import drafter_fingerprint

    if compressor.hidden_size != drafter.config.hidden_size:
        raise SpecjaxError(f"compressor width {compressor.hidden_size} != drafter hidden size "
                           f"{drafter.config.hidden_size}")
    if compressor.drafter_fingerprint is not None:
        actual = drafter_fingerprint(drafter.params, drafter.draft_vocab)
        if actual != compressor.drafter_fingerprint:
            raise SpecjaxError(f"{compressor.source} was trained for drafter {compressor.drafter_fingerprint}, but "
                               f"{drafter.source} is drafter {actual}; retrain it (specjax train-compressor)")
    try:
        config = compressor.window if window is None else dataclasses.replace(compressor.window, window=window)
        drafter_config = dataclasses.replace(drafter.config, window=config)
    except ValueError as e:
        raise SpecjaxError(str(e)) from None
    return dataclasses.replace(drafter, config=drafter_config,
                               params={**drafter.params, "compressor": compressor.params})
