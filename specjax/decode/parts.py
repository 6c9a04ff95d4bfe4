"""What the decoding methods of a run need besides the target, resolved once per run.

The registry of methods (decode/slots.py:SLOT_METHODS) says what each method reads: a drafter, a
refiner, a tree config. `resolve_parts` loads those parts once for every method a run uses (the
drafter windowed with its compressor when asked, at the target's compute precision, the refiner
checked against that drafter), so generate, bench and serve share one path.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from specjax.decode.slots import slot_method
from specjax.io.dflash import LoadedDrafter, check_pair
from specjax.io.refiner import LoadedRefiner, check_refiner
from specjax.io.registry import (LoadedModel, at_compute_dtype, resolve_compressor, resolve_drafter,
                                 resolve_refiner)


@dataclasses.dataclass(frozen=True)
class PartsSpec:
    """Where a run's parts come from, as the user named them."""

    drafter: str = "default"
    """"default" (the committed drafter of a known model) or a DFlash-format folder."""
    refiner: str = "default"
    """"default" or a refiner folder; loaded only for the +refiner methods."""
    compressor: str = "default"
    """The segment compressor for windowed drafting; loaded only with drafter_window."""
    drafter_window: int = 0
    """> 0: the drafter attends to this many recent positions plus summaries (bounded memory)."""
    block_size: int | None = None
    """If set, the drafter must have been trained for this block size."""


@dataclasses.dataclass(frozen=True)
class MethodParts:
    drafter: LoadedDrafter | None
    refiner: LoadedRefiner | None


def resolve_parts(methods: Sequence[str], model: LoadedModel, model_ref: str,
                  spec: PartsSpec = PartsSpec()) -> MethodParts:
    """Load what `methods` need for `model` (named `model_ref` on the command line), once."""
    needs = [slot_method(m) for m in methods]
    drafter = refiner = None
    if any(m.needs_drafter for m in needs):
        drafter = resolve_drafter(spec.drafter, model_ref)
        check_pair(drafter, model.config, spec.block_size)
        if spec.drafter_window:
            from specjax.io.compressor import windowed_drafter

            drafter = windowed_drafter(drafter, resolve_compressor(spec.compressor, model_ref), spec.drafter_window)
        drafter = at_compute_dtype(drafter, model.config.dtype)  # the pair computes at one precision
    if any(m.needs_refiner for m in needs):
        refiner = resolve_refiner(spec.refiner, model_ref)
        check_refiner(refiner, drafter)
    return MethodParts(drafter, refiner)
