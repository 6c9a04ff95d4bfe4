"""Segment-compressor checkpoints (windowed drafting): a folder with config.json and model.safetensors.

config.json holds `architectures: ["SpecjaxSegmentCompressor"]`, the DrafterWindow it was trained
with (window, segment, summaries), the drafter width, and the fingerprint of the drafter it was
trained for. Tensors are named by their flax parameter paths joined with ".".
`windowed_drafter` turns a loaded drafter plus a compressor into a windowed drafter.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specjax.errors import SpecjaxError
from specjax.io.addons import params_from_tensors, read_addon_tensors, save_addon
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
    cfg = {"architectures": [ARCHITECTURE], **dataclasses.asdict(window), "hidden_size": hidden_size,
           "drafter_fingerprint": fingerprint}
    if extra:
        cfg["training"] = extra
    save_addon(folder, params, cfg, dtype)


def load_compressor(folder: str | Path) -> LoadedCompressor:
    from specjax.io.dflash import read_config_folder

    folder, cfg = read_config_folder(folder, "compressor")
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise SpecjaxError(f"{folder}: not a specjax segment compressor (architectures must include {ARCHITECTURE!r})")
    try:
        window = DrafterWindow(window=int(cfg["window"]), segment=int(cfg["segment"]), summaries=int(cfg["summaries"]))
        hidden = int(cfg["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise SpecjaxError(f"{folder / 'config.json'}: bad compressor config ({e})") from None
    tensors = read_addon_tensors(folder, "compressor")
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
    params = params_from_tensors(tensors)
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
