"""Live serving metrics: a sink the scheduler reports to, exported in Prometheus text format.

Names follow vLLM's where vLLM has one (`vllm:` becomes `specjax:`), so dashboards and habits carry
over: spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens(_per_pos), num_requests_running
/ waiting, kv_cache_usage_perc, and the latency histograms. Mean acceptance length over a window =
1 + accepted / drafts. Nothing here imports decoding: the scheduler calls these methods.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges in seconds, dense where a CPU-served small model lands (tens of ms to tens of s).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServingMetrics:
    """Counters, gauges and histograms of one serving engine (its own registry, so several engines in
    one process, as in tests, never collide)."""

    def __init__(self, method: str, log_path: str | Path | None = None, snapshot_every: float = 1.0):
        """log_path: a JSON-lines run log (`specjax report` plots it): one `"kind": "request"` line
        per finished request and, every snapshot_every seconds while the engine reports, one
        `"kind": "snapshot"` line of the live signals over that interval."""
        self.registry = CollectorRegistry()
        self._speculation_metrics(self.registry)
        self._load_and_memory_metrics(self.registry)
        self._step_metrics(self.registry, method)
        self._controller_metrics(self.registry)
        self._output_and_latency_metrics(self.registry)
        self._lock = threading.Lock()
        self._log = open(log_path, "a") if log_path else None
        self.snapshot_every = snapshot_every
        self._last_snapshot: tuple[float, dict[str, float]] | None = None  # (time, the counters then)

    def _speculation_metrics(self, r: CollectorRegistry) -> None:
        """Drafts proposed and accepted, tokens and finished requests (vLLM's names)."""
        self.drafts = Counter("specjax:spec_decode_num_drafts", "Verify steps that checked a draft (per request row)",
                              registry=r)
        self.draft_tokens = Counter("specjax:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specjax:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("specjax:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.generation_tokens = Counter("specjax:generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("specjax:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.requests = Counter("specjax:request_success", "Finished requests by finish reason", ["finished_reason"],
                                registry=r)

    def _load_and_memory_metrics(self, r: CollectorRegistry) -> None:
        """Requests running and waiting, and the KV cache in use."""
        self.running = Gauge("specjax:num_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge("specjax:num_requests_waiting", "Requests queued for a slot", registry=r)
        self.kv_usage = Gauge("specjax:kv_cache_usage_perc", "Fraction of target KV slots holding a token", registry=r)
        self.kv_bytes = Gauge("specjax:kv_cache_bytes_in_use", "Bytes of target KV and drafter context holding tokens",
                              ["part"], registry=r)
        self.kv_bytes_per_token = Gauge("specjax:kv_cache_bytes_per_token", "Bytes one token occupies", ["part"],
                                        registry=r)

    def _step_metrics(self, r: CollectorRegistry, method: str) -> None:
        """Device-call time by phase, its achieved rates against the machine's peak, and the method."""
        self.step_seconds = Gauge("specjax:step_seconds",
                                  "Wall seconds of the last device call: prefill, step, and the step's draft / refine "
                                  "/ verify share (apportioned by phase costs measured at start-up)", ["phase"],
                                  registry=r)
        self.achieved = Gauge("specjax:step_achieved_per_second",
                              "The last step's modelled work over its wall time (resource: flops, bytes)",
                              ["resource"], registry=r)
        self.peak = Gauge("specjax:machine_peak_per_second", "The machine's measured peak (resource: flops, bytes)",
                          ["resource"], registry=r)
        self.utilization = Gauge("specjax:step_utilization",
                                 "Achieved over peak: near 1 for bytes means memory-bound, for flops compute-bound; "
                                 "low for both means overheads dominate", ["resource"], registry=r)
        self.current_method = Gauge("specjax:method_info", "The decoding method in use (value 1)", ["method"],
                                    registry=r)
        self.current_method.labels(method=method).set(1)

    def _controller_metrics(self, r: CollectorRegistry) -> None:
        """The adaptive controller's decisions and predictions, and the KV alarm and relief it acts on."""
        # The adaptive controller's decisions, predictions and the memory alarm it acts on.
        self.policy_info = Gauge("specjax:policy_info", "The policy the last device call ran (value 1; others 0)",
                                 ["policy"], registry=r)
        self.switches = Counter("specjax:policy_switches", "Policy changes by reason (faster, probe, pinned, ready)",
                                ["reason"], registry=r)
        self.predicted_per_step = Gauge("specjax:controller_predicted_tokens_per_step",
                                        "Committed tokens per step the controller expected of its choice", registry=r)
        self.measured_per_step = Gauge("specjax:controller_measured_tokens_per_step",
                                       "Committed tokens per step the last call measured", registry=r)
        self.predicted_rate = Gauge("specjax:controller_predicted_tokens_per_second",
                                    "Each ready policy's predicted committed tokens per second at the current batch",
                                    ["policy"], registry=r)
        self.arrival_rate = Gauge("specjax:arrival_rate_per_second", "Requests per second over the last 64 arrivals",
                                  registry=r)
        self.kv_budget = Gauge("specjax:kv_cache_budget_bytes", "The KV budget (0: none set)", registry=r)
        self.kv_to_budget = Gauge("specjax:kv_cache_projected_seconds_to_budget",
                                  "Seconds until the bytes in use reach the budget at their recent growth (-1: never)",
                                  registry=r)
        self.kv_alarm = Gauge("specjax:kv_cache_alarm", "1 while the KV projection or high water mark is alarmed",
                              registry=r)
        self.preemptions = Counter("specjax:preemptions", "Requests preempted (recomputed later) under KV pressure",
                                   registry=r)
        self.drafter_drops = Counter("specjax:drafter_states_dropped",
                                     "Requests whose drafter state was dropped under KV pressure (they go on "
                                     "without drafts)", registry=r)

    def _output_and_latency_metrics(self, r: CollectorRegistry) -> None:
        """Lossy options' agreement, repetition in outputs, and latency histograms."""
        self.lossy_checked = Counter("specjax:lossy_requests_checked",
                                     "Greedy requests under a lossy option, by whether their whole output equals "
                                     "the lossless run's", ["identical"], registry=r)
        self.lossy_agreement_ratio = Gauge("specjax:lossy_agreement_ratio",
                                           "Share of the last 64 lossy greedy requests whose output equals the "
                                           "lossless run's", registry=r)
        self._lossy: list[float] = []
        self.drafter_windows = Counter("specjax:drafter_states_windowed",
                                       "Requests whose drafter was windowed to its recent context under KV pressure "
                                       "(they go on speculating)", registry=r)
        self.distinct = Gauge("specjax:output_distinct_n", "Mean distinct-n of the last 64 finished outputs "
                              "(repetition shows as a low value)", ["n"], registry=r)
        self._distinct: dict[str, list[float]] = {"2": [], "3": []}
        histogram = lambda name, doc: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = histogram("specjax:time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("specjax:inter_token_latency_seconds", "Gap between streamed chunks, per token")
        self.e2e = histogram("specjax:e2e_request_latency_seconds", "Arrival to the last token")
        self.queue_time = histogram("specjax:request_queue_time_seconds", "Arrival to prefill")

    # ---- events the scheduler reports ----

    def queue_depth(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def admitted(self, queue_seconds: float, prompt_tokens: int) -> None:
        self.queue_time.observe(queue_seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens_streamed(self, count: int, gap_seconds: float | None) -> None:
        """count new tokens reached a request; gap_seconds since its previous chunk (None for the first)."""
        self.generation_tokens.inc(count)
        if gap_seconds is not None and count:
            # A speculative chunk carries several tokens; per-token latency is the gap shared among them.
            for _ in range(count):
                self.itl.observe(gap_seconds / count)

    def verify_steps(self, steps: int, draft_tokens: int, accepted_per_position: list[int]) -> None:
        """Rows' verify steps since the last report, the draft tokens they checked and how many
        reached each draft position."""
        if draft_tokens == 0:
            return
        self.drafts.inc(steps)
        self.draft_tokens.inc(draft_tokens)
        self.accepted_tokens.inc(sum(accepted_per_position))
        for position, count in enumerate(accepted_per_position, start=1):
            self.accepted_per_pos.labels(position=str(position)).inc(count)

    def memory(self, kv_usage: float, bytes_in_use: dict[str, int], bytes_per_token: dict[str, int]) -> None:
        self.kv_usage.set(kv_usage)
        for part, value in bytes_in_use.items():
            self.kv_bytes.labels(part=part).set(value)
        for part, value in bytes_per_token.items():
            self.kv_bytes_per_token.labels(part=part).set(value)

    def timing(self, phase: str, seconds: float) -> None:
        self.step_seconds.labels(phase=phase).set(seconds)

    def roofline(self, flops_per_s: float, bytes_per_s: float, peak_flops_per_s: float,
                 peak_bytes_per_s: float) -> None:
        """The stall estimate of the last step: achieved FLOP/s and bytes/s against the peaks."""
        for resource, achieved, peak in (("flops", flops_per_s, peak_flops_per_s),
                                         ("bytes", bytes_per_s, peak_bytes_per_s)):
            self.achieved.labels(resource=resource).set(achieved)
            self.peak.labels(resource=resource).set(peak)
            self.utilization.labels(resource=resource).set(achieved / peak if peak else 0.0)

    def policy(self, policy: str, reason: str | None) -> None:
        """The next calls run `policy`; reason: why it changed (None at start-up)."""
        for sample in list(self.policy_info.collect()[0].samples):
            self.policy_info.labels(policy=sample.labels["policy"]).set(0)
        self.policy_info.labels(policy=policy).set(1)
        if reason is not None:
            self.switches.labels(reason=reason).inc()

    def controller(self, predicted_tokens_per_step: float, predicted_tokens_per_s: dict[str, float],
                   arrival_rate: float) -> None:
        self.predicted_per_step.set(predicted_tokens_per_step)
        for policy, value in predicted_tokens_per_s.items():
            self.predicted_rate.labels(policy=policy).set(value)
        self.arrival_rate.set(arrival_rate)

    def measured_tokens_per_step(self, value: float) -> None:
        self.measured_per_step.set(value)

    def memory_budget(self, budget: int, seconds_to_budget: float, alarm: bool) -> None:
        self.kv_budget.set(budget)
        self.kv_to_budget.set(seconds_to_budget if seconds_to_budget != float("inf") else -1)
        self.kv_alarm.set(1 if alarm else 0)

    def preempted(self) -> None:
        self.preemptions.inc()

    def drafter_state_dropped(self) -> None:
        self.drafter_drops.inc()

    def drafter_state_windowed(self) -> None:
        self.drafter_windows.inc()

    def lossy_agreement(self, identical: bool) -> None:
        self.lossy_checked.labels(identical=str(identical).lower()).inc()
        self._lossy.append(1.0 if identical else 0.0)
        del self._lossy[:-64]
        self.lossy_agreement_ratio.set(sum(self._lossy) / len(self._lossy))

    def finished(self, reason: str, e2e_seconds: float, record: dict | None = None) -> None:
        self.requests.labels(finished_reason=reason).inc()
        self.e2e.observe(e2e_seconds)
        for n, values in self._distinct.items():
            value = None if record is None else record.get(f"distinct_{n}")
            if value is not None:
                values.append(value)
                del values[:-64]
                self.distinct.labels(n=n).set(sum(values) / len(values))
        if record is not None:
            self._write({"kind": "request", "time": time.time(), **record})

    def tick(self, now: float | None = None) -> None:
        """Called by the engine after each device call: writes a snapshot to the run log when
        snapshot_every seconds have passed since the last one."""
        if self._log is None:
            return
        now = time.time() if now is None else now
        if self._last_snapshot is None:
            self._last_snapshot = (now, self._counters())
        elif now - self._last_snapshot[0] >= self.snapshot_every:
            self._write(self.snapshot(now))

    def snapshot(self, now: float | None = None) -> dict:
        """The live signals, with rates and acceptance over the interval since the last snapshot."""
        now = time.time() if now is None else now
        counters = self._counters()
        then, before = self._last_snapshot or (now, {name: 0.0 for name in counters})
        self._last_snapshot = (now, counters)
        delta = {name: counters[name] - before.get(name, 0.0) for name in counters}
        seconds = now - then
        drafts = delta["drafts"]
        positions = sorted((int(name.split(":")[1]), name) for name in counters if name.startswith("pos:"))
        value = self.registry.get_sample_value
        return {
            "kind": "snapshot", "time": now, "interval_s": seconds,
            "policy": next((s.labels["policy"] for s in self.policy_info.collect()[0].samples if s.value == 1), None),
            "tokens_per_s": delta["tokens"] / seconds if seconds > 0 else None,
            # Mean acceptance length and per-position acceptance of the rows' verify steps in the interval.
            "tau": 1.0 + delta["accepted"] / drafts if drafts else None,
            "per_position_acceptance": [delta[name] / drafts for _, name in positions] if drafts else [],
            "running": value("specjax:num_requests_running"), "waiting": value("specjax:num_requests_waiting"),
            "arrival_rate": value("specjax:arrival_rate_per_second"),
            "kv_bytes": {s.labels["part"]: s.value for s in self.kv_bytes.collect()[0].samples},
            "kv_budget": value("specjax:kv_cache_budget_bytes"), "kv_alarm": value("specjax:kv_cache_alarm"),
            "predicted_tokens_per_step": value("specjax:controller_predicted_tokens_per_step"),
            "measured_tokens_per_step": value("specjax:controller_measured_tokens_per_step"),
            "step_s": value("specjax:step_seconds", {"phase": "step"}),
            "preemptions": counters["preemptions"], "drafter_drops": counters["drafter_drops"],
            "drafter_windows": counters["drafter_windows"], "switches": counters["switches"],
        }

    def _counters(self) -> dict[str, float]:
        """Totals of the counters a snapshot turns into rates (every label summed, per position kept)."""
        def total(counter) -> float:
            return sum(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))
        out = {"tokens": total(self.generation_tokens), "drafts": total(self.drafts),
               "accepted": total(self.accepted_tokens), "preemptions": total(self.preemptions),
               "drafter_drops": total(self.drafter_drops), "drafter_windows": total(self.drafter_windows),
               "switches": total(self.switches)}
        for sample in self.accepted_per_pos.collect()[0].samples:
            if sample.name.endswith("_total"):
                out[f"pos:{sample.labels['position']}"] = sample.value
        return out

    def _write(self, record: dict) -> None:
        if self._log is None:
            return
        with self._lock:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()

    # ---- export ----

    def prometheus_text(self) -> str:
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._log is not None:
            if self._last_snapshot is not None:
                self._write(self.snapshot())
            self._log.close()
            self._log = None
