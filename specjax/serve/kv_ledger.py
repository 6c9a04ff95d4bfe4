"""What each slot holds in KV memory, counted as a paged allocator would count its pages: the slot
arrays are allocated once, and the KV budget bounds what live requests occupy of them.

The scheduler keeps one `KvLedger`: it updates the per-slot lengths at every sync, asks it whether a
request may be admitted under the budget, and hands its `held_rows` to `relieve_memory` when the
bytes in use pass the high water mark.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from specjax.decode import slots as slot_api
from specjax.decode.memory import drafter_state_breakdown, target_kv_bytes
from specjax.serve.controller import HeldRow
from specjax.serve.requests import LiveRequest, Request


class KvLedger:
    """Per-slot cache lengths and the bytes they stand for."""

    def __init__(self, statics: slot_api.SlotStatics, drafts_from_retrieval: bool):
        slots = statics.slot.slots
        self.lengths = np.zeros(slots, np.int64)
        """[S] each slot's target cache length at the last sync."""
        self.drafting_lengths = np.zeros(slots, np.int64)
        """[S] each slot's drafting-context length (rapid, rapid+block) at the last sync."""
        self.capacity = slots * statics.slot.cache_length
        self.from_retrieval = drafts_from_retrieval
        self.bytes_per_token = {"target": target_kv_bytes(statics.target_config, 1, 1)}
        if statics.rapid is not None:  # the drafting context is a second target cache
            self.bytes_per_token["drafter"] = self.bytes_per_token["target"]
        if statics.drafter_config is not None:
            per_token = drafter_state_breakdown(statics.drafter_config, 1, 64).get("drafter_bytes_per_token")
            if per_token:
                self.bytes_per_token["drafter"] = per_token

    @property
    def counts_drafter(self) -> bool:
        return "drafter" in self.bytes_per_token

    def move(self, source: int, target: int) -> None:
        self.lengths[target] = self.lengths[source]
        self.drafting_lengths[target] = self.drafting_lengths[source]

    def _drafts_from(self, row: LiveRequest | Request) -> tuple[int, ...]:
        """What a row's drafter context holds: its drafting prompt on a retrieval server, else its prompt."""
        if isinstance(row, Request):
            return row.drafting_prompt if self.from_retrieval and row.drafting_prompt is not None else row.prompt
        return row.drafting_prompt if self.from_retrieval else row.prompt

    def bytes_after_admitting(self, live: Mapping[int, LiveRequest], batch: list[LiveRequest], request: Request,
                              resumed: int) -> int:
        """Bytes the running requests, an admission's batch so far and `request` (with `resumed`
        tokens from before a preemption) will hold once their prompts are in. A row still
        prefilling in chunks is counted at its whole prompt."""
        target, drafter = self.bytes_per_token["target"], self.bytes_per_token.get("drafter", 0)
        drafting = self.drafting_lengths if self.from_retrieval else self.lengths
        held = sum(max(int(self.lengths[slot]), len(row.prompt)) * target
                   + row.drafting_held(max(int(drafting[slot]), len(self._drafts_from(row)))) * drafter
                   for slot, row in live.items())
        held += sum(len(row.prompt) * target + len(self._drafts_from(row)) * drafter for row in batch)
        return held + (len(request.prompt) + resumed) * target + (len(self._drafts_from(request)) + resumed) * drafter

    def in_use(self, live: Mapping[int, LiveRequest]) -> tuple[float, dict[str, int]]:
        """(the fraction of cache slots live requests fill, their bytes by holder)."""
        tokens = sum(int(self.lengths[slot]) for slot in live)
        in_use = {"target": tokens * self.bytes_per_token["target"]}
        if self.counts_drafter:
            held = self.drafting_lengths if self.from_retrieval else self.lengths
            drafting = sum(row.drafting_held(int(held[slot])) for slot, row in live.items() if row.holds_drafter)
            in_use["drafter"] = drafting * self.bytes_per_token["drafter"]
        return tokens / self.capacity, in_use

    def held_rows(self, live: Mapping[int, LiveRequest]) -> list[HeldRow]:
        """The decoding rows, as `relieve_memory` weighs them."""
        return [HeldRow(slot, row.admitted, int(self.lengths[slot]), row.holds_drafter and self.counts_drafter,
                        speculating=row.draft_limit > 0,
                        drafter_tokens=int(self.drafting_lengths[slot]) if self.from_retrieval else None,
                        drafter_window=row.drafter_window)
                for slot, row in live.items() if not row.prefilling]
