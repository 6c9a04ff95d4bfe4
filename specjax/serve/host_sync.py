"""The host sync after each device call: one transfer of what the rows did, new tokens detokenized
and streamed to their handles, finished rows' slots freed with their results, and the call reported
to the controller (what it committed) and the monitor (time, phases, roofline, KV memory)."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from specjax.decode.engine import lossless_agreement
from specjax.monitor.serving import ServingMetrics
from specjax.serve.config import ServeConfig
from specjax.serve.controller import Controller
from specjax.serve.kv_relief import KvRelief
from specjax.serve.reporting import StepReporter, request_metrics
from specjax.serve.requests import Chunk, LiveRequest, RequestResult
from specjax.serve.shapes import ServingShapes
from specjax.serve.slot_table import SlotTable

log = logging.getLogger("specjax.serve")


class _Synced(NamedTuple):
    """What one host sync reads from the slot state, as numpy, one row per slot."""

    tokens: Any
    """[S, N + block] committed generated tokens."""
    counts: Any
    """[S] committed generated tokens per row."""
    done: Any
    """[S] finished or empty."""
    steps: Any
    """[S] verify steps the row took part in."""
    histogram: Any
    """[S, block] verify steps by drafts accepted."""
    lengths: Any
    """[S] filled target cache slots."""
    drafted: Any
    """[S] draft tokens checked."""
    drafting_lengths: Any
    """[S] drafting-context slots (rapid, rapid+block), or None."""
    lossless_diverged_at: Any = None
    """[S] where lossy rows left the lossless run (SlotState.lossless_diverged_at), or None."""


class HostSync:
    """Syncs the slot state with the requests holding it; run by the scheduler thread."""

    def __init__(self, table: SlotTable, shapes: ServingShapes, model, controller: Controller,
                 metrics: ServingMetrics, reporter: StepReporter, relief: KvRelief, config: ServeConfig):
        self.table, self.statics, self.model, self.controller = table, shapes.statics, model, controller
        self.metrics, self.reporter, self.relief, self.config = metrics, reporter, relief, config
        self.drafts_from_retrieval = shapes.drafts_from_retrieval

    def collect(self, step: tuple[float, int, int] | None) -> None:
        """One host sync: stream new tokens, finish rows that ended, report metrics. step: (start
        time, attention length, rows) of the device call being synced, None after prefills alone."""
        state = self.table.state
        # One transfer for everything the sync reads (the drafting contexts' lengths too, when kept).
        synced = jax.device_get(_Synced(
            state.tokens, state.num_generated, state.done, state.steps, state.accepted_histogram, state.lengths,
            state.drafted, state.drafting_lengths if self.drafts_from_retrieval else None,
            state.lossless_diverged_at))
        now = time.perf_counter()
        if step is not None:
            self.report_step(now - step[0], step[1], step[2], synced.steps, synced.drafted, step[3])
            self.observe_call(now - step[0], step[1], step[2], step[3], synced)
        self.table.kv.lengths[:] = synced.lengths
        if self.drafts_from_retrieval:
            self.table.kv.drafting_lengths[:] = synced.drafting_lengths
        for slot, live in list(self.table.live.items()):
            if live.prefilling:
                continue
            try:
                self.sync_slot(slot, live, synced, now)
            except Exception as error:  # noqa: BLE001 - one request's failure (say, its detokenizing) is its own
                log.exception("request %d failed", live.handle.id)
                self.finish(slot, live, "error", now, synced.steps[slot], synced.histogram[slot],
                             error=f"{type(error).__name__}: {error}")
        self.relief.report()
        self.metrics.tick()

    def observe_call(self, seconds: float, attend: int, rows: int, policy: str, synced) -> None:
        """Tell the controller what the call did: committed tokens, row steps and, for chains, how
        often each draft position was verified and accepted (within each row's draft limit)."""
        counts, steps, histogram = synced.counts, synced.steps, synced.histogram
        drafts = self.controller.drafts.get(policy)
        width = max(self.statics.block - 1, 0)
        reached, verified = np.zeros(width), np.zeros(width)
        row_steps = committed = decoding = 0
        for slot, live in self.table.live.items():
            if live.prefilling:
                continue
            decoding += 1
            stepped = int(steps[slot]) - live.steps_reported
            row_steps += stepped
            committed += int(counts[slot]) - live.generated_reported
            live.generated_reported = int(counts[slot])
            if stepped:
                live.policy_steps[policy] = live.policy_steps.get(policy, 0) + stepped
            if drafts and stepped:
                delta = np.asarray(histogram[slot], np.int64) - live.histogram_reported
                tail = delta[::-1].cumsum()[::-1]  # tail[n]: steps that accepted at least n drafts
                k = min(drafts, live.draft_limit)
                verified[:k] += tail[:k]
                reached[:k] += tail[1 : k + 1]
            live.histogram_reported = np.asarray(histogram[slot], np.int64)
        self.controller.observe_call(policy, rows, attend, seconds, row_steps, committed, reached, verified)
        if row_steps:  # committed per step over the rows, comparable with the prediction
            self.metrics.measured_tokens_per_step(committed * decoding / row_steps)

    def sync_slot(self, slot: int, live: LiveRequest, synced, now: float) -> None:
        tokens, counts, done, steps, histogram, drafted = (synced.tokens, synced.counts, synced.done, synced.steps,
                                                           synced.histogram, synced.drafted)
        request = live.handle.request
        block = self.statics.block
        ids = live.resumed + tokens[slot, : int(counts[slot])].tolist()  # every token of the request so far
        count = len(ids)
        carry = live.handle._carry
        if synced.lossless_diverged_at is not None and int(synced.lossless_diverged_at[slot]) >= 0:
            # Counted from the request's first token: a resumed row's tokens so far are in its prompt.
            carry.setdefault("lossless_diverged_at", len(live.resumed) + int(synced.lossless_diverged_at[slot]))
        new, text_delta, reason = live.detokenize(ids, self.model.tokenizer, bool(done[slot]))
        if new or text_delta:
            if live.first_token_at is None:
                live.first_token_at = now
                self.metrics.first_token(now - live.arrived)
            self.metrics.tokens_streamed(len(new), None if live.last_chunk_at is None else now - live.last_chunk_at)
            live.last_chunk_at = now
            live.emitted += len(new)
            live.handle._push(Chunk(new, text_delta))
        # Speculative counters: verify steps and draft positions reached since the last sync.
        if block > 1:
            reached = histogram[slot][::-1].cumsum()[::-1][1:]  # steps whose run reached draft slot k
            self.metrics.verify_steps(int(steps[slot]) - live.steps_reported,
                                      int(drafted[slot]) - live.drafted_reported,
                                      (reached - live.reached_reported).tolist())
            live.reached_reported = reached
        live.steps_reported, live.drafted_reported = int(steps[slot]), int(drafted[slot])
        if reason is None and done[slot]:
            at_limit = count >= request.max_tokens and not self.ends_with_eos(ids)
            reason = "length" if at_limit else "stop"
        if reason is None and live.handle.cancelled:
            reason = "cancelled"
        if reason is not None:
            self.finish(slot, live, reason, now, steps[slot], histogram[slot])

    def ends_with_eos(self, ids) -> bool:
        return len(ids) > 0 and int(ids[-1]) in self.model.eos_token_ids

    def finish(self, slot: int, live: LiveRequest, reason: str, now: float, steps, histogram,
                error: str | None = None) -> None:
        del self.table.live[slot]  # the slot is free now; the next insert overwrites its row
        self.table.pins.pop(slot, None)
        carry = live.handle._carry
        ids = [t for chunk in live.handle._chunks for t in chunk.token_ids]
        steps = int(steps) + carry.get("steps", 0)
        histogram = np.asarray(histogram) + carry.get("histogram", 0)
        live.drafted_reported += carry.get("drafted", 0)
        metrics = self.request_metrics(live, now, steps, histogram, ids)
        result = RequestResult(ids, live.text, reason, error, metrics)
        live.handle._push(result=result)
        self.metrics.finished(reason, now - live.arrived, {"id": live.handle.id, "finish_reason": reason, **metrics})
        self.metrics.queue_depth(len(self.table.live), len(self.table.waiting))

    def request_metrics(self, live: LiveRequest, now: float, steps: int, histogram: np.ndarray, ids=()) -> dict:
        """Per-request metrics (reporting.request_metrics), with a lossy method's label and agreement."""
        lossy = None
        if self.statics.rapid is not None and self.statics.rapid.lossy:
            lossy = {"lossy": self.statics.rapid.lossy_label, "lossless_agreement": self.lossless_agreement(live, ids)}
        return request_metrics(live, now, steps, histogram, ids, method=self.config.method,
                               precision=self.model.config.precision, block=self.statics.block,
                               drafts_from_retrieval=self.drafts_from_retrieval, lossy=lossy)

    def lossless_agreement(self, live: LiveRequest, ids) -> dict | None:
        """A lossy greedy request against the lossless run: the tokens before the first that differs
        (SlotState.lossless_diverged_at) and whether the whole output is the lossless one; None for a
        sampled request, whose lossless run is a draw of its own."""
        if live.handle.request.temperature > 0:
            return None
        agreement = lossless_agreement([live.handle._carry.get("lossless_diverged_at", -1)], [len(ids)])
        self.metrics.lossy_agreement(agreement["identical"][0])
        return {"identical": agreement["identical"][0], "prefix_tokens": agreement["prefix_tokens"][0]}

    def report_step(self, seconds: float, attend: int, rows: int, steps, drafted, policy: str) -> None:
        # Called before the rows sync, so each request's *_reported counts are those of the last sync.
        steps_done = sum(int(steps[slot]) - live.steps_reported for slot, live in self.table.live.items())
        drafted_done = sum(int(drafted[slot]) - live.drafted_reported for slot, live in self.table.live.items())
        self.reporter.report(seconds, attend, rows, steps_done, drafted_done, policy)

    def fail_all(self, message: str) -> None:
        now = time.perf_counter()
        self.table.pins.clear()
        for slot, live in list(self.table.live.items()):
            del self.table.live[slot]
            live.handle._push(result=RequestResult([], live.text, "error", message, {"e2e_s": now - live.arrived}))
            self.metrics.finished("error", now - live.arrived)
