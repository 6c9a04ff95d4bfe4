"""`specjax top`: a terminal dashboard of a running server, refreshed every second from /metrics.

It shows what an operator watches under load: tau (mean acceptance length) over the last interval
and overall, per-position acceptance as bars, KV memory, TTFT and inter-token latency percentiles
(estimated from the Prometheus histograms), output throughput, the queue, the step's time and its
draft/refine/verify split, and the stall estimate (achieved bytes/s and FLOP/s against the peaks).
"""

from __future__ import annotations

import dataclasses
import time

from specjax.errors import SpecjaxError


@dataclasses.dataclass
class Snapshot:
    """The numbers one /metrics scrape gives, keyed the way the dashboard reads them."""

    at: float
    counters: dict[str, float]
    per_position: dict[int, float]
    gauges: dict[str, float]
    histograms: dict[str, list[tuple[float, float]]]
    """name -> cumulative (upper bound, count) buckets."""
    method: str = "?"


def parse_metrics(text: str, at: float | None = None) -> Snapshot:
    from prometheus_client.parser import text_string_to_metric_families

    counters, per_position, gauges, histograms, method = {}, {}, {}, {}, "?"
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("specjax:")
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_total"):
                if name == "spec_decode_num_accepted_tokens_per_pos":
                    per_position[int(sample.labels["position"])] = sample.value
                elif name == "request_success":
                    counters[f"finished_{sample.labels.get('finished_reason', '?')}"] = sample.value
                elif name == "policy_switches":
                    counters[f"switches_{sample.labels.get('reason', '?')}"] = sample.value
                else:
                    counters[name] = sample.value
            elif family.type == "gauge":
                if name == "method_info":
                    method = sample.labels.get("method", "?")
                elif sample.labels:
                    gauges[f"{name}:{next(iter(sample.labels.values()))}"] = sample.value
                else:
                    gauges[name] = sample.value
            elif family.type == "histogram" and sample.name.endswith("_bucket"):
                histograms.setdefault(name, []).append((float(sample.labels["le"]), sample.value))
    return Snapshot(time.time() if at is None else at, counters, per_position, gauges, histograms, method)


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile from cumulative buckets, linear within a bucket."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def _delta(new: Snapshot, old: Snapshot | None, key: str) -> float:
    return new.counters.get(key, 0.0) - (old.counters.get(key, 0.0) if old else 0.0)


def summarize(new: Snapshot, old: Snapshot | None) -> dict:
    """What the dashboard shows, from two scrapes (old None: since the server started)."""
    drafts = new.counters.get("spec_decode_num_drafts", 0.0)
    accepted = new.counters.get("spec_decode_num_accepted_tokens", 0.0)
    window_drafts = _delta(new, old, "spec_decode_num_drafts")
    window_accepted = _delta(new, old, "spec_decode_num_accepted_tokens")
    seconds = new.at - old.at if old else None
    tokens = _delta(new, old, "generation_tokens")
    return {
        "method": new.method,
        "tau_overall": 1 + accepted / drafts if drafts else None,
        "tau_window": 1 + window_accepted / window_drafts if window_drafts else None,
        "per_position": [new.per_position[k] / drafts if drafts else 0.0 for k in sorted(new.per_position)],
        "running": new.gauges.get("num_requests_running", 0.0),
        "waiting": new.gauges.get("num_requests_waiting", 0.0),
        "kv_usage": new.gauges.get("kv_cache_usage_perc", 0.0),
        "kv_bytes": {k.split(":", 1)[1]: v for k, v in new.gauges.items() if k.startswith("kv_cache_bytes_in_use:")},
        "tokens_per_s": tokens / seconds if seconds else None,
        "generated": new.counters.get("generation_tokens", 0.0),
        "finished": {k.removeprefix("finished_"): v for k, v in new.counters.items() if k.startswith("finished_")},
        "ttft": {q: histogram_quantile(new.histograms.get("time_to_first_token_seconds", []), q) for q in (.5, .9, .99)},
        "itl": {q: histogram_quantile(new.histograms.get("inter_token_latency_seconds", []), q) for q in (.5, .9, .99)},
        "step_s": new.gauges.get("step_seconds:step"),
        "phases": {phase: new.gauges[f"step_seconds:{phase}"] for phase in ("draft", "refine", "verify")
                   if f"step_seconds:{phase}" in new.gauges},
        "utilization": {resource: new.gauges.get(f"step_utilization:{resource}") for resource in ("bytes", "flops")},
        # The adaptive controller: what it runs, why it switched, what it expected against what came.
        "policy": next((k.split(":", 1)[1] for k, v in new.gauges.items() if k.startswith("policy_info:") and v), None),
        "switches": {k.removeprefix("switches_"): v for k, v in new.counters.items() if k.startswith("switches_")},
        "predicted_per_step": new.gauges.get("controller_predicted_tokens_per_step"),
        "measured_per_step": new.gauges.get("controller_measured_tokens_per_step"),
        "predicted_rates": {k.split(":", 1)[1]: v for k, v in new.gauges.items()
                            if k.startswith("controller_predicted_tokens_per_second:")},
        "kv_budget": new.gauges.get("kv_cache_budget_bytes", 0.0),
        "kv_to_budget": new.gauges.get("kv_cache_projected_seconds_to_budget"),
        "kv_alarm": bool(new.gauges.get("kv_cache_alarm", 0.0)),
        "preemptions": new.counters.get("preemptions", 0.0),
        "drafter_drops": new.counters.get("drafter_states_dropped", 0.0),
        "drafter_windows": new.counters.get("drafter_states_windowed", 0.0),
        "distinct": {n: new.gauges[f"output_distinct_n:{n}"] for n in ("2", "3") if f"output_distinct_n:{n}" in new.gauges},
    }


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else (f"{value * 1e3:.0f} ms" if value < 10 else f"{value:.1f} s")


def render(view: dict, url: str):
    """A rich renderable of the dashboard."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    tau = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    throughput = "-" if view["tokens_per_s"] is None else f"{view['tokens_per_s']:.1f}"
    head = Table.grid(padding=(0, 3))
    head.add_row(f"[b]method[/b] {view['method']}", f"[b]tau[/b] {tau(view['tau_window'])} (last interval), "
                 f"{tau(view['tau_overall'])} overall", f"[b]throughput[/b] {throughput} tok/s")
    head.add_row(f"[b]running[/b] {view['running']:.0f}  [b]waiting[/b] {view['waiting']:.0f}",
                 f"[b]KV in use[/b] {view['kv_usage'] * 100:.1f}% "
                 + " ".join(f"{part} {value / 2**20:.1f} MiB" for part, value in view["kv_bytes"].items()),
                 f"[b]step[/b] {_fmt_s(view['step_s'])}"
                 + "".join(f" {phase} {_fmt_s(value)}" for phase, value in view.get("phases", {}).items()))
    use = view.get("utilization", {})
    if use.get("bytes") is not None:
        share = lambda v: f"{v * 100:.0f}%"  # noqa: E731
        bound = "memory-bound" if use["bytes"] > max(0.5, use["flops"] or 0) else (
            "compute-bound" if (use["flops"] or 0) > 0.5 else "neither near peak: overheads")
        head.add_row(f"[b]stall[/b] {share(use['bytes'])} of peak bytes/s, {share(use['flops'] or 0)} of peak FLOP/s",
                     bound, "")
    if view.get("policy"):
        switches = ", ".join(f"{k} {v:.0f}" for k, v in sorted(view["switches"].items())) or "none"
        per_step = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rates = "  ".join(f"{p} {v:.1f}" for p, v in sorted(view["predicted_rates"].items(), key=lambda x: -x[1]))
        head.add_row(f"[b]policy[/b] {view['policy']}  [b]switches[/b] {switches}",
                     f"[b]tokens/step[/b] predicted {per_step(view['predicted_per_step'])}, "
                     f"measured {per_step(view['measured_per_step'])}", f"[b]predicted tok/s[/b] {rates}")
    if view.get("kv_budget"):
        to_budget = view["kv_to_budget"]
        head.add_row(f"[b]KV budget[/b] {view['kv_budget'] / 2**20:.1f} MiB"
                     + ("  [b red]ALARM[/b red]" if view["kv_alarm"] else ""),
                     "reached in " + ("never (not growing)" if to_budget is None or to_budget < 0
                                      else f"{to_budget:.1f} s at the current growth"),
                     f"[b]preempted[/b] {view['preemptions']:.0f}  [b]drafters windowed[/b] "
                     f"{view.get('drafter_windows', 0):.0f}  [b]drafter states dropped[/b] {view['drafter_drops']:.0f}")
    if view.get("distinct"):
        head.add_row("[b]output distinct-n[/b] " + ", ".join(f"{n}: {v:.2f}" for n, v in view["distinct"].items()),
                     "(low means repetition)", "")
    latency = Table(title="latency", expand=False)
    for column in ("", "p50", "p90", "p99"):
        latency.add_column(column, justify="right")
    for name in ("ttft", "itl"):
        latency.add_row(name.upper(), *(_fmt_s(view[name][q]) for q in (.5, .9, .99)))
    bars = Table(title="acceptance per draft position", expand=False)
    bars.add_column("pos", justify="right")
    bars.add_column("rate", justify="right")
    bars.add_column("")
    for position, rate in enumerate(view["per_position"], start=1):
        bars.add_row(str(position), f"{rate:.2f}", "█" * int(round(rate * 40)))
    finished = ", ".join(f"{k} {v:.0f}" for k, v in sorted(view["finished"].items())) or "none yet"
    return Panel(Group(head, latency, bars, f"finished: {finished}; generated {view['generated']:.0f} tokens"),
                 title=f"specjax top — {url}")


def fetch(url: str) -> str:
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/metrics", timeout=5)
    except httpx.HTTPError as error:
        raise SpecjaxError(f"cannot read {url}/metrics: {error}") from None
    if response.status_code != 200:
        raise SpecjaxError(f"{url}/metrics answered {response.status_code}")
    return response.text


def run_top(url: str, interval: float = 1.0, iterations: int | None = None) -> None:
    """Refresh the dashboard every `interval` seconds until Ctrl-C (or `iterations` refreshes)."""
    from rich.live import Live

    previous = None
    with Live(refresh_per_second=4, screen=False) as live:
        count = 0
        while iterations is None or count < iterations:
            try:
                snapshot = parse_metrics(fetch(url))
                live.update(render(summarize(snapshot, previous), url))
                previous = snapshot
            except SpecjaxError as error:
                from rich.text import Text

                live.update(Text(f"specjax top: {error} (retrying)", style="red"))
            count += 1
            time.sleep(interval)
