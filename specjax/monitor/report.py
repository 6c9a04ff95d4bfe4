"""The monitoring report of a serving run: `specjax report RUN.jsonl` turns the server's run log
(`specjax serve --metrics-log RUN.jsonl`) into one PNG and a summary.

The log holds two kinds of JSON lines (see `ServingMetrics`): a snapshot of the live signals every
`snapshot_every` seconds, and one record per finished request. The figure shows, over time:
acceptance length and per-position acceptance, the policy the controller ran, KV bytes against the
budget (with the alarm and preemptions), load and throughput; and latency percentiles against load,
where load is how many requests were in the server when a request arrived.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError

MIB = 2**20


def read_run_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(snapshots, requests) of a run log, each in time order. Lines without a kind are request
    records (logs written before snapshots existed)."""
    path = Path(path)
    if not path.is_file():
        raise SpecjaxError(f"no run log at {path}: start the server with --metrics-log {path}")
    snapshots, requests = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise SpecjaxError(f"{path}:{number} is not a JSON line ({error.msg})") from None
        if not isinstance(record, dict) or "time" not in record:
            raise SpecjaxError(f"{path}:{number} is not a run-log record (a JSON object with a time)")
        (snapshots if record.get("kind") == "snapshot" else requests).append(record)
    if not snapshots and not requests:
        raise SpecjaxError(f"{path} holds no records: did the server finish any request?")
    return sorted(snapshots, key=lambda r: r["time"]), sorted(requests, key=lambda r: r["time"])


def request_latencies(requests: list[dict]) -> dict[str, np.ndarray]:
    """Per finished request: arrival time, TTFT and TPOT in seconds (NaN where undefined), and the
    load at arrival: the requests already in the server (queued or decoding) when it arrived."""
    done = [r for r in requests if r.get("e2e_s") is not None]
    finish = np.array([r["time"] for r in done], float)
    arrival = finish - np.array([r["e2e_s"] for r in done], float)
    ttft = np.array([np.nan if r.get("ttft_s") is None else r["ttft_s"] for r in done], float)
    tokens = np.array([r.get("completion_tokens", 0) for r in done], float)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(tokens > 1, (finish - arrival - ttft) / (tokens - 1), np.nan)
    load = np.array([int(np.sum((arrival < a) & (finish > a))) for a in arrival], int)
    return {"arrival": arrival, "finish": finish, "ttft": ttft, "tpot": tpot, "load": load, "tokens": tokens}


def _run_start(snapshots: list[dict], lat: dict) -> float:
    """The earliest moment the log covers: the first snapshot's interval or request's arrival."""
    return min([s["time"] - s.get("interval_s", 0.0) for s in snapshots] + list(lat["arrival"]))


def summarize(snapshots: list[dict], requests: list[dict]) -> dict:
    """The run in numbers: what the figure shows, for the terminal and for JSON."""
    lat = request_latencies(requests)
    start = _run_start(snapshots, lat)
    end = max([s["time"] for s in snapshots] + list(lat["finish"]))
    policy_seconds: Counter = Counter()
    for snapshot in snapshots:  # time spent decoding under each policy (an idle server runs none)
        if snapshot.get("policy") and snapshot.get("tokens_per_s"):
            policy_seconds[snapshot["policy"]] += snapshot.get("interval_s", 0.0)
    total_policy = sum(policy_seconds.values())
    taus = [(s["tau"], s["interval_s"]) for s in snapshots if s.get("tau") is not None]
    kv = [sum(s.get("kv_bytes", {}).values()) for s in snapshots]
    pct = lambda values, q: None if not np.isfinite(values).any() else float(np.nanpercentile(values, q))  # noqa: E731
    return {
        "duration_s": end - start,
        "requests": len(requests),
        "finish_reasons": dict(Counter(r.get("finish_reason", "?") for r in requests)),
        "completion_tokens": int(lat["tokens"].sum()),
        "output_tokens_per_s": float(lat["tokens"].sum() / (end - start)) if end > start else None,
        "tau": sum(t * w for t, w in taus) / sum(w for _, w in taus) if taus and sum(w for _, w in taus) else None,
        "policy_time_share": {p: s / total_policy for p, s in policy_seconds.most_common()} if total_policy else {},
        "switches": max([s.get("switches", 0) for s in snapshots], default=0),
        "preemptions": max([s.get("preemptions", 0) for s in snapshots] +
                           [r.get("preemptions", 0) for r in requests], default=0),
        "drafter_states_dropped": max([s.get("drafter_drops", 0) for s in snapshots], default=0),
        "drafter_states_windowed": max([s.get("drafter_windows", 0) for s in snapshots], default=0),
        "kv_bytes_max": max(kv, default=None),
        "kv_budget": next((s["kv_budget"] for s in snapshots if s.get("kv_budget")), None),
        "kv_alarm_s": sum(s.get("interval_s", 0.0) for s in snapshots if s.get("kv_alarm")),
        "ttft_p50_s": pct(lat["ttft"], 50), "ttft_p99_s": pct(lat["ttft"], 99),
        "tpot_p50_s": pct(lat["tpot"], 50), "tpot_p99_s": pct(lat["tpot"], 99),
    }


def plot_report(snapshots: list[dict], requests: list[dict], out: str | Path, title: str = "") -> Path:
    """Write the report's PNG to out and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = request_latencies(requests)
    start = _run_start(snapshots, lat)
    t = np.array([s["time"] - start for s in snapshots], float)
    fig, axes = plt.subplots(6, 1, figsize=(11, 17), gridspec_kw={"height_ratios": [2, 2, 1.2, 2, 2, 2.4]})
    acc, pos_ax, pol_ax, kv_ax, load_ax, lat_ax = axes
    for ax in axes[1:-1]:
        ax.sharex(acc)
    for ax in axes[:-1]:
        ax.grid(alpha=0.3)
        ax.set_xlabel("time since the first record (s)")

    _plot_acceptance(acc, t, snapshots)
    _plot_positions(pos_ax, t, snapshots)
    _plot_policy(pol_ax, t, snapshots)
    _plot_kv(kv_ax, t, snapshots)
    _plot_load(load_ax, t, snapshots)
    _plot_latency(lat_ax, lat)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _plot_acceptance(acc, t: np.ndarray, snapshots: list[dict]) -> None:
    """Acceptance length per row, and the controller's batch prediction against its measurement."""
    busy = np.array([bool(s.get("tokens_per_s")) for s in snapshots])
    value = lambda key: np.array([s[key] if s.get(key) is not None else np.nan for s in snapshots], float)  # noqa
    acc.plot(t, value("tau"), ".-", label="tau over the interval (per row)")
    acc.set_ylabel("tokens per verify step, per row")
    batch_ax = acc.twinx()
    batch_ax.plot(t, np.where(busy, value("measured_tokens_per_step"), np.nan), "-", color="tab:orange", alpha=0.6,
                  label="controller: measured (batch)")
    batch_ax.plot(t, np.where(busy, value("predicted_tokens_per_step"), np.nan), "--", color="tab:green", alpha=0.6,
                  label="controller: predicted (batch)")
    batch_ax.set_ylabel("tokens per step, summed over the batch")
    acc.set_title("Acceptance length, and the controller's prediction against what it measured")
    handles = acc.get_legend_handles_labels()[0] + batch_ax.get_legend_handles_labels()[0]
    acc.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")


def _plot_positions(pos_ax, t: np.ndarray, snapshots: list[dict]) -> None:
    """Per-position acceptance, the first 8 draft positions."""
    width = min(max((len(s.get("per_position_acceptance", [])) for s in snapshots), default=0), 8)
    for k in range(width):
        rate = [s["per_position_acceptance"][k] if len(s.get("per_position_acceptance", [])) > k else np.nan
                for s in snapshots]
        pos_ax.plot(t, rate, ".-", ms=3, label=f"draft {k + 1}")
    pos_ax.set_ylim(-0.02, 1.02)
    pos_ax.set_ylabel("fraction of verify steps")
    pos_ax.set_title("Per-position acceptance (a draft position reached and accepted; the first 8)")
    if width:
        pos_ax.legend(fontsize=7, ncol=width, loc="upper right")


def _plot_policy(pol_ax, t: np.ndarray, snapshots: list[dict]) -> None:
    """The policy each device call ran."""
    policies = list(dict.fromkeys(s.get("policy") or "?" for s in snapshots))
    index = [policies.index(s.get("policy") or "?") for s in snapshots]
    pol_ax.step(t, index, where="post")
    pol_ax.set_yticks(range(len(policies)), policies)
    pol_ax.set_ylim(-0.5, max(len(policies) - 0.5, 0.5))
    pol_ax.set_title("Policy the last device call ran")


def _plot_kv(kv_ax, t: np.ndarray, snapshots: list[dict]) -> None:
    """KV bytes in use by part, the budget, the alarm, and the relief events."""
    parts = sorted({p for s in snapshots for p in s.get("kv_bytes", {})})
    if parts:
        kv_ax.stackplot(t, [[s.get("kv_bytes", {}).get(p, 0.0) / MIB for s in snapshots] for p in parts],
                        labels=[f"{p} KV" for p in parts], alpha=0.7, step="post")
    budget = next((s["kv_budget"] for s in snapshots if s.get("kv_budget")), None)
    if budget:
        kv_ax.axhline(budget / MIB, color="red", ls="--", label="budget")
    alarm = np.array([bool(s.get("kv_alarm")) for s in snapshots])
    if alarm.any():
        kv_ax.fill_between(t, 0, 1, where=alarm, step="post", color="red", alpha=0.12,
                           transform=kv_ax.get_xaxis_transform(), label="alarm")
    preempt = np.diff([0.0] + [s.get("preemptions", 0.0) for s in snapshots])
    for when in t[preempt > 0]:
        kv_ax.axvline(when, color="black", lw=0.8, alpha=0.6)
    drops = np.diff([0.0] + [s.get("drafter_drops", 0.0) for s in snapshots])
    for when in t[drops > 0]:
        kv_ax.axvline(when, color="tab:purple", lw=0.8, ls=":", alpha=0.8)
    windows = np.diff([0.0] + [s.get("drafter_windows", 0.0) for s in snapshots])
    for when in t[windows > 0]:
        kv_ax.axvline(when, color="tab:green", lw=0.8, ls="--", alpha=0.8)
    kv_ax.set_ylabel("MiB")
    kv_ax.set_title("KV bytes in use (black lines: preemptions; dotted: drafter states dropped; "
                    "dashed: drafters windowed)")
    if kv_ax.get_legend_handles_labels()[0]:
        kv_ax.legend(fontsize=8, loc="upper left")


def _plot_load(load_ax, t: np.ndarray, snapshots: list[dict]) -> None:
    """Requests decoding and waiting, and output tokens/s."""
    load_ax.plot(t, [s.get("running") or 0 for s in snapshots], label="decoding")
    load_ax.plot(t, [s.get("waiting") or 0 for s in snapshots], label="waiting")
    load_ax.set_ylabel("requests")
    rate_ax = load_ax.twinx()
    rate_ax.plot(t, [np.nan if s.get("tokens_per_s") is None else s["tokens_per_s"] for s in snapshots],
                 color="tab:green", alpha=0.8, label="output tokens/s")
    rate_ax.set_ylabel("output tokens/s")
    load_ax.set_title("Load and throughput")
    handles = load_ax.get_legend_handles_labels()[0] + rate_ax.get_legend_handles_labels()[0]
    load_ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")


def _plot_latency(lat_ax, lat: dict) -> None:
    """TPOT and TTFT percentiles against the load each request met at arrival."""
    lat_ax.grid(alpha=0.3)
    if len(lat["load"]):
        loads = np.unique(lat["load"])
        for name, values, marker in (("TPOT", lat["tpot"], "o"), ("TTFT", lat["ttft"], "s")):
            for q, style in ((50, "-"), (99, "--")):
                ys = [np.nanpercentile(values[lat["load"] == n], q) if np.isfinite(values[lat["load"] == n]).any()
                      else np.nan for n in loads]
                lat_ax.plot(loads, np.array(ys) * 1e3, style, marker=marker, label=f"{name} p{q}")
        lat_ax.set_yscale("log")
        lat_ax.legend(fontsize=8)
    lat_ax.set_xlabel("requests already in the server at arrival")
    lat_ax.set_ylabel("ms")
    lat_ax.set_title("Latency percentiles against load")
