"""What the scheduler tells the monitor and the caller: each device call's time, split by phase and
set against the machine's peaks (`StepReporter`), and each finished request's metrics, named as vLLM's
and SGLang's responses name them (`request_metrics`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.data.repetition import distinct_n
from specjax.decode import slots as slot_api
from specjax.decode.budget import LatencyModel
from specjax.decode.roofline import StepShape, step_work
from specjax.monitor.serving import ServingMetrics
from specjax.serve.requests import LiveRequest


class StepReporter:
    """Reports a device call: its time, its estimated split into drafting and verifying, and the
    FLOP/s and bytes/s it reached against the machine's measured peaks."""

    def __init__(self, metrics: ServingMetrics, work_shape: StepShape, peaks, block: int, steps_per_sync: int,
                 latency: LatencyModel | None):
        self.metrics, self.work_shape, self.peaks, self.block = metrics, work_shape, peaks, block
        self.steps_per_sync, self.latency = steps_per_sync, latency
        self.phase_seconds: dict[str, float] = {}
        """Chains: each phase's share of a step, measured once the programs are compiled."""

    def report(self, seconds: float, attend: int, rows: int, steps_done: int, drafted_done: int, policy: str) -> None:
        """steps_done and drafted_done: row steps and drafts checked over the call."""
        self.metrics.timing("step", seconds)
        # Tokens each row verified per step (1 + drafts checked), from the rows that stepped.
        verify_tokens = 1.0 + (drafted_done / steps_done if steps_done else self.block - 1)
        method = slot_api.slot_method(policy)
        phases = self.phase_seconds if method.needs_drafter else {"verify": 1.0}
        if method.needs_tree and self.latency is not None:  # the latency model's drafting and verify costs
            phases = {"draft": self.latency.fixed_s,
                      "verify": float(np.interp(verify_tokens, self.latency.sizes, self.latency.verify_s))}
        total = sum(phases.values())
        for phase, cost in phases.items():
            self.metrics.timing(phase, seconds * cost / total)
        flops, bytes_read = step_work(dataclasses.replace(self.work_shape, rows=rows), verify_tokens, attend)
        calls = self.steps_per_sync
        self.metrics.roofline(calls * flops / seconds, calls * bytes_read / seconds, self.peaks.flops_per_s,
                              self.peaks.bytes_per_s)


def request_metrics(live: LiveRequest, now: float, steps: int, histogram: np.ndarray, ids, *, method: str,
                    precision: str, block: int, drafts_from_retrieval: bool,
                    lossy: dict[str, Any] | None = None) -> dict:
    """A finished request's metrics. steps and histogram: its verify steps and accepted-length
    histogram over every residency; lossy: the lossy label and its agreement with the lossless run,
    for a lossy method."""
    request = live.handle.request
    out = {
        "queue_s": live.admitted - live.arrived,
        "ttft_s": None if live.first_token_at is None else live.first_token_at - live.arrived,
        "e2e_s": now - live.arrived,
        "prompt_tokens": len(request.prompt),
        **({"drafting_prompt_tokens": len(live.drafting_prompt) - len(live.resumed)} if drafts_from_retrieval else {}),
        "completion_tokens": live.emitted,
        "method": method,
        "precision": precision,
        # Per-request control and what the batch ran while the request decoded.
        "speculation": request.speculation,
        "method_requested": request.method,
        "draft_limit": live.draft_limit,
        "policy_steps": dict(live.policy_steps),
        "preemptions": live.handle._carry.get("preemptions", 0),
        "drafter_state_dropped": not live.holds_drafter,
        "drafter_windowed": live.drafter_window > 0,
        **(lossy or {}),
        # Quality beside speed: high acceptance from degenerate repetition shows as low distinct-n.
        "distinct_2": distinct_n(ids, 2),
        "distinct_3": distinct_n(ids, 3),
    }
    if block > 1:
        committed = float((histogram * (np.arange(len(histogram)) + 1)).sum())
        reached = histogram[::-1].cumsum()[::-1][1:]
        out["speculative_decoding"] = {
            "mean_acceptance_length": committed / steps if steps else 0.0,
            # Accepted over checked draft tokens (a tree checks all its nodes, a chain its block).
            "acceptance_rate": float(reached.sum() / live.drafted_reported) if live.drafted_reported else 0.0,
            "per_position_acceptance": (reached / steps).tolist() if steps else [],
            "acceptance_histogram": histogram.tolist(),
            "verify_steps": steps,
            "draft_tokens": live.drafted_reported,
        }
    return out
