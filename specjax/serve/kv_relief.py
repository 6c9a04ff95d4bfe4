"""KV relief: what live requests hold, reported at every sync, and past the KV budget's high water
mark the excess freed, least lost first (controller.relieve_memory): drafter contexts windowed,
then drafter states dropped, then the newest requests preempted (parked on the host, or their
tokens so far recomputed as part of their prompt when admitted again)."""

from __future__ import annotations

import logging
import time

import jax

from specjax.monitor.serving import ServingMetrics
from specjax.serve.config import ServeConfig
from specjax.serve.controller import Controller, relieve_memory
from specjax.serve.programs import Programs
from specjax.serve.slot_table import SlotTable

log = logging.getLogger("specjax.serve")


class KvRelief:
    """Reports KV memory and frees it past the high water mark; run by the scheduler thread."""

    def __init__(self, table: SlotTable, programs: Programs, controller: Controller, metrics: ServingMetrics,
                 config: ServeConfig, window: int | None):
        """window: the context positions a windowed drafter keeps (None: windowing is no relief here)."""
        self.table, self.programs, self.controller = table, programs, controller
        self.metrics, self.config = metrics, config
        self.window = window

    def report(self) -> None:
        """Report what live requests hold; past the KV budget's high water mark, free the excess:
        drafter states first (speculation is lost, no work), then the newest requests are preempted
        (parked on the host, or their tokens so far recomputed as part of their prompt)."""
        filled, bytes_in_use = self.table.kv.in_use(self.table.live)
        self.metrics.memory(filled, bytes_in_use, self.table.kv.bytes_per_token)
        state = self.controller.observe_memory(sum(bytes_in_use.values()), time.perf_counter())
        self.table.memory_state = state
        self.metrics.memory_budget(state.budget, state.seconds_to_budget, state.alarm)
        high_water = int(self.config.controller.kv_high_water * state.budget)
        if not state.budget or state.bytes_in_use < high_water:
            return
        relief = relieve_memory(self.table.kv.held_rows(self.table.live), self.table.kv.bytes_per_token,
                                state.bytes_in_use - high_water, self.window)
        for slot in relief.preempt:
            self.preempt(slot)
        for slot in relief.drop_drafter:
            self.drop_drafter_state(slot)
        for slot in relief.window_drafter:
            self.window_drafter(slot)

    def drop_drafter_state(self, slot: int) -> None:
        """The row decodes on without drafts (a draft limit of 0 is exact under every policy), and its
        drafter context no longer counts against the budget."""
        live = self.table.live[slot]
        live.holds_drafter = False
        live.draft_limit = 0
        self.table.pins.pop(slot, None)
        self.table.state = self.table.state.replace(draft_limit=self.table.state.draft_limit.at[slot].set(0))
        self.metrics.drafter_state_dropped()
        log.info("dropped the drafter state of request %d: KV bytes past the high water mark", live.handle.id)

    def window_drafter(self, slot: int) -> None:
        """The row's drafter reads only its last `_relief_window` context positions from now on; the
        row keeps speculating (drafts only, so output is unchanged) and its older drafter K/V no
        longer count against the budget."""
        live = self.table.live[slot]
        live.drafter_window = self.window
        windows = self.table.state.drafter_window.at[slot].set(live.drafter_window)
        self.table.state = self.table.state.replace(drafter_window=windows)
        self.metrics.drafter_state_windowed()
        log.info("windowed the drafter of request %d to its last %d positions: KV bytes past the high water mark",
                 live.handle.id, live.drafter_window)

    def preempt(self, slot: int) -> None:
        live = self.table.live.pop(slot)
        self.table.pins.pop(slot, None)
        handle = live.handle
        if self.config.preemption == "park":
            # The row's whole state goes to the host as it is: restored, the request goes on bit for bit.
            handle._parked = (jax.device_get(self.programs.program("take_row")(self.table.state, slot)), live)
            handle._carry["preemptions"] = handle._carry.get("preemptions", 0) + 1
            with self.table.lock:
                self.table.waiting.appendleft((handle, live.arrived))
            self.metrics.preempted()
            self.metrics.queue_depth(len(self.table.live), len(self.table.waiting))
            log.info("preempted request %d at %d tokens, parked on the host: KV bytes past the high water mark",
                     handle.id, live.emitted)
            return
        handle._resume = [t for chunk in handle._chunks for t in chunk.token_ids]
        histogram = live.histogram_reported if live.histogram_reported is not None else 0
        carry = handle._carry
        carry.update(steps=carry.get("steps", 0) + live.steps_reported,
                     histogram=carry.get("histogram", 0) + histogram,
                     drafted=carry.get("drafted", 0) + live.drafted_reported,
                     policy_steps=dict(live.policy_steps), preemptions=carry.get("preemptions", 0) + 1)
        with self.table.lock:
            self.table.waiting.appendleft((handle, live.arrived))
        self.metrics.preempted()
        self.metrics.queue_depth(len(self.table.live), len(self.table.waiting))
        log.info("preempted request %d at %d tokens: KV bytes past the high water mark", handle.id,
                 len(handle._resume))
