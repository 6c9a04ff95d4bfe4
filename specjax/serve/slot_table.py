"""What the scheduler thread owns: the slot state on the device, the request holding each slot, the
policies requests pinned, the queue of requests waiting for a slot, and what the slots hold in KV
memory. Admission, the host sync and KV relief each read and update it; only the scheduler thread
does, except the queue, which `submit` appends to under `lock`."""

from __future__ import annotations

import collections
import dataclasses
import threading

from specjax.decode import slots as slot_api
from specjax.serve.kv_ledger import KvLedger
from specjax.serve.requests import LiveRequest, RequestHandle


@dataclasses.dataclass
class SlotTable:
    state: slot_api.SlotState
    """Every slot's decode state (caches included), on the server's devices."""
    kv: KvLedger
    """Each slot's cache lengths at the last sync, and the bytes they stand for."""
    live: dict[int, LiveRequest] = dataclasses.field(default_factory=dict)
    """slot -> the request holding it."""
    pins: dict[int, str] = dataclasses.field(default_factory=dict)
    """slot -> the policy its request pinned (a method override on an adaptive server)."""
    waiting: collections.deque[tuple[RequestHandle, float]] = dataclasses.field(default_factory=collections.deque)
    """(handle, arrival time) of the requests waiting for a slot, oldest first; a preempted request
    goes back to the head."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """Guards `waiting` against submitting threads."""
    memory_state: object | None = None
    """The controller's last view of KV memory (`Controller.observe_memory`): an alarm holds admission."""

    def free_slots(self, slots: int) -> list[int]:
        return [s for s in range(slots) if s not in self.live]
