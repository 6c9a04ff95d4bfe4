"""Admission: waiting requests into free slots. Requests parked by a preemption are written back
first; the others are prefilled together (up to insert_rows per device call), while the KV budget
allows, and long prompts a chunk per scheduler turn."""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import jax
import numpy as np

from specjax.decode import slots as slot_api
from specjax.monitor.serving import ServingMetrics
from specjax.serve.config import ServeConfig
from specjax.serve.controller import Controller
from specjax.serve.programs import Programs
from specjax.serve.requests import LiveRequest, Request, RequestHandle, RequestResult
from specjax.serve.rules import RequestRules
from specjax.serve.slot_table import SlotTable

log = logging.getLogger("specjax.serve")


class Admission:
    """Moves requests from the queue into slots; run by the scheduler thread, once per turn."""

    def __init__(self, table: SlotTable, programs: Programs, rules: RequestRules, controller: Controller,
                 metrics: ServingMetrics, config: ServeConfig, tokenizer, finish: Callable,
                 pin_for: Callable[[Request], str | None]):
        """finish: ends a live request (HostSync.finish); pin_for: the policy a request pins."""
        self.table, self.programs, self.rules, self.controller = table, programs, rules, controller
        self.metrics, self.config, self.tokenizer = metrics, config, tokenizer
        self.finish, self.pin_for = finish, pin_for
        self.shapes, self.statics, self.parts = programs.shapes, programs.statics, programs.parts
        self.drafts_from_retrieval = programs.shapes.drafts_from_retrieval

    def drop_cancelled(self) -> None:
        with self.table.lock:
            kept: collections.deque[tuple[RequestHandle, float]] = collections.deque()
            for handle, arrived in self.table.waiting:
                if handle.cancelled:
                    self.finish_unstarted(handle, arrived, "cancelled")
                else:
                    kept.append((handle, arrived))
            self.table.waiting = kept

    def finish_unstarted(self, handle: RequestHandle, arrived: float, reason: str, error: str | None = None):
        e2e = time.perf_counter() - arrived
        handle._push(result=RequestResult([], "", reason, error, {"e2e_s": e2e, "queue_s": e2e}))
        self.metrics.finished(reason, e2e)

    def memory_allows(self, batch: list[LiveRequest], request: Request, resumed: int) -> bool:
        """Under a KV budget, admit only while no alarm is raised and the request's tokens fit below
        the high water mark beside what the running requests and this admission's batch hold (a
        request alone is always admitted, so nothing waits forever)."""
        budget = self.controller.kv_budget
        if not budget or not (batch or self.table.live):
            return True
        if self.table.memory_state is not None and self.table.memory_state.alarm:
            return False
        held = self.table.kv.bytes_after_admitting(self.table.live, batch, request, resumed)
        return held <= self.config.controller.kv_high_water * budget

    def admit(self) -> bool:
        """Prefill waiting requests into free slots, up to insert_rows of them per device call.
        Requests parked by a preemption (at the head of the queue) are written back first. True if
        any request entered a slot (its first token is then ready to stream)."""
        free = self.table.free_slots(self.config.slots)
        admitted = False
        while free and self.table.waiting:
            with self.table.lock:
                handle, _ = self.table.waiting[0]
                row = None if handle._parked is None else handle._parked[0]
                if row is None or not self.memory_allows([], handle.request, int(row.num_generated)):
                    break
                self.table.waiting.popleft()
            self.restore(free.pop(0), handle)
            admitted = True
        while free:
            batch: list[tuple[int, LiveRequest]] = []
            with self.table.lock:
                while self.table.waiting and len(batch) < min(len(free), self.statics.slot.insert_rows):
                    handle, arrived = self.table.waiting[0]
                    request = handle.request
                    # A parked request waits at the head until it can be written back (above): it holds
                    # tokens it must not prefill again, and nothing behind it goes first.
                    if handle._parked is not None or not self.memory_allows([x for _, x in batch], request,
                                                                             len(handle._resume)):
                        break
                    self.table.waiting.popleft()
                    seed = handle._carry.get("seed")
                    if seed is None:
                        seed = request.seed
                        if seed is None:
                            seed = int(np.random.default_rng().integers(2**32))
                        handle._carry["seed"] = seed
                    resumed = list(handle._resume)
                    text = "" if not resumed or self.tokenizer is None else self.tokenizer.decode(resumed)
                    # A resumed request draws from a stream of its own, so it does not replay its first draws.
                    live = LiveRequest(handle, arrived, admitted=0.0, seed=(seed + len(resumed)) % 2**32,
                                 reached_reported=np.zeros(max(self.statics.block - 1, 0), np.int64),
                                 emitted=len(resumed), text=text, resumed=resumed,
                                 draft_limit=self.rules.row_limit(request),
                                 histogram_reported=np.zeros(self.statics.block, np.int64),
                                 policy_steps=dict(handle._carry.get("policy_steps", {})))
                    batch.append((free[len(batch)], live))
            if not batch:
                break
            try:
                self.prefill(batch)
            except Exception as error:  # noqa: BLE001 - a failed prefill fails the requests in it only
                log.exception("prefill failed")
                for _, live in batch:
                    self.finish_unstarted(live.handle, live.arrived, "error", f"{type(error).__name__}: {error}")
                continue
            now = time.perf_counter()
            for slot, live in batch:
                free.remove(slot)
                live.admitted = now
                pin = self.pin_for(live.handle.request)
                if pin is not None:
                    self.table.pins[slot] = pin
                self.metrics.admitted(now - live.arrived, len(live.handle.request.prompt))
                self.table.live[slot] = live
            self.metrics.queue_depth(len(self.table.live), len(self.table.waiting))
            admitted = True
        return admitted

    def prefill(self, batch: list[tuple[int, LiveRequest]]) -> None:
        """One insert call: fresh rows get their whole prompt (or its first chunk, when longer than
        prefill_chunk), up to insert_rows of them; a row already holding part of its prompt gets its
        next chunk (one row per call).

        A chunked prompt's first chunk is the remainder (len mod chunk, or a whole chunk), so every
        later chunk is exactly prefill_chunk real tokens ending at most at the prompt's end: no
        padding is written past the prompt, where a padded chunk could run off the cache.

        On a rapid or rapid+block server every prompt goes in whole, with its drafting prompt."""
        chunk, shapes = self.shapes.prefill_chunk, self.shapes
        starts = [live.prefilled for _, live in batch]
        if any(starts):  # the next chunk, after what the row holds
            if len(batch) != 1:
                raise RuntimeError("continued prompt chunks are prefilled one row per call")
            prompt = batch[0][1].prompt
            takes, key, width, offsets, rows = [prompt[starts[0]: starts[0] + chunk]], ("extend",), chunk, starts, 1
        else:  # whole prompts, or first chunks, into fresh rows, padded to a compiled row count
            takes = [live.prompt for _, live in batch]
            takes = [p if not chunk or len(p) <= chunk else p[: len(p) % chunk or chunk] for p in takes]
            width = max(shapes.bucket_for(len(t)) for t in takes)
            rows = next(size for size in shapes.insert_sizes if size >= len(batch))
            key, offsets = ("insert", width, rows), None
        tokens = slot_api.token_rows(takes, width, rows)
        requests = [live.handle.request for _, live in batch]
        lives = [live for _, live in batch]
        pad = rows - len(batch)
        insert = self.programs.insert_request(
            [slot for slot, _ in batch] + [self.config.slots] * pad, tokens, [len(t) for t in takes] + [1] * pad,
            [r.max_tokens - len(x.resumed) for r, x in zip(requests, lives)] + [1] * pad,
            [live.seed for _, live in batch] + [0] * pad,
            [r.temperature for r in requests] + [0.0] * pad, [r.top_k for r in requests] + [0] * pad,
            [r.top_p for r in requests] + [1.0] * pad,
            final=[start + len(t) == len(x.prompt) for start, t, x in zip(starts, takes, lives)] + [True] * pad,
            offsets=offsets, limits=[x.draft_limit for x in lives] + [self.statics.block - 1] * pad)
        started = time.perf_counter()
        self.table.state = self.programs.insert(key)(self.parts, self.table.state, insert)
        if self.drafts_from_retrieval:  # whole prompts only (prefill_chunk is 0); then the rows' drafting contexts
            drafts_from = [live.drafting_prompt for _, live in batch] + [(0,)] * pad
            width = next(b for b in shapes.drafting_buckets if b >= max(map(len, drafts_from)))
            fill = self.programs.drafting_fill(width, rows)
            arguments = self.programs.drafting_fill_arguments(insert.rows, drafts_from, width)
            self.table.state = fill(self.parts, self.table.state, *arguments)
        jax.block_until_ready(self.table.state.lengths)  # so the prefill's time is its own
        self.metrics.timing("prefill", time.perf_counter() - started)
        for (slot, live), start, take in zip(batch, starts, takes):
            live.prefilled = start + len(take)
            self.table.kv.lengths[slot] = live.prefilled
            if self.drafts_from_retrieval:
                self.table.kv.drafting_lengths[slot] = len(live.drafting_prompt)
            live.generated_reported = 0 if live.prefilling else 1  # the prefill's token is no step's

    def continue_prefills(self) -> bool:
        """The next chunk of every slot whose prompt is still being prefilled (one per turn, so the
        slots that decode wait for at most one chunk per row between their steps). True if a prompt
        is now whole (its first token is then ready to stream)."""
        completed = False
        for slot, live in list(self.table.live.items()):
            if not live.prefilling:
                continue
            now = time.perf_counter()
            if live.handle.cancelled:
                self.finish(slot, live, "cancelled", now, 0, np.zeros(self.statics.block, np.int64))
                continue
            try:
                self.prefill([(slot, live)])
            except Exception as error:  # noqa: BLE001 - one bad prefill fails its own request only
                log.exception("prefill failed")
                self.finish(slot, live, "error", now, 0, np.zeros(self.statics.block, np.int64),
                             error=f"{type(error).__name__}: {error}")
                continue
            completed = completed or not live.prefilling
        return completed

    def restore(self, slot: int, handle: RequestHandle) -> None:
        """Write a parked request's state row back into a free slot; it decodes on where it stopped."""
        row, live = handle._parked
        handle._parked = None
        self.table.state = self.programs.program("put_row")(self.table.state, jax.device_put(row), slot)
        self.table.kv.lengths[slot] = int(row.lengths)
        if self.drafts_from_retrieval:
            self.table.kv.drafting_lengths[slot] = int(row.drafting_lengths)
        live.admitted = time.perf_counter()
        pin = self.pin_for(handle.request)
        if pin is not None:
            self.table.pins[slot] = pin
        self.table.live[slot] = live
        self.metrics.queue_depth(len(self.table.live), len(self.table.waiting))
        log.info("restored request %d from the host at %d tokens", handle.id, int(row.num_generated))
