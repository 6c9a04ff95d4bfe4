"""A load generator for an OpenAI-compatible server, after `vllm bench serve`: gamma-distributed
arrivals at a request rate (burstiness 1 = Poisson) or a fixed concurrency, streamed requests, and
TTFT / TPOT / ITL / E2EL percentiles, throughput and goodput. Loopback only, and bounded in request
count and in time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from urllib.parse import urlparse

import numpy as np

from specjax.errors import SpecjaxError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool
    status: int
    ttft_s: float | None = None
    e2el_s: float | None = None
    output_tokens: int = 0
    gaps_s: list[float] = dataclasses.field(default_factory=list)
    """Gaps between streamed chunks (a speculative chunk carries several tokens)."""
    error: str = ""


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    request_rate: float = math.inf
    """Mean arrivals per second; inf sends every request at once."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular."""
    max_concurrency: int | None = None
    """At most this many requests in flight (None: no limit)."""
    num_requests: int = 100
    max_tokens: int = 128
    time_limit_s: float = 600.0
    """Requests not finished by then are cancelled and counted as failed."""
    chat: bool = True
    seed: int = 0

    def __post_init__(self):
        if not self.request_rate > 0:
            raise SpecjaxError(f"request rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise SpecjaxError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise SpecjaxError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_requests < 1 or self.max_tokens < 1 or not self.time_limit_s > 0:
            raise SpecjaxError("num_requests, max_tokens and the time limit must be positive")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SpecjaxError(f"the load generator only targets loopback ({', '.join(LOOPBACK)}), not {host!r}")


def arrival_times(spec: LoadSpec) -> np.ndarray:
    """Send time of each request, seconds from the start."""
    if math.isinf(spec.request_rate):
        return np.zeros(spec.num_requests)
    rng = np.random.default_rng(spec.seed)
    gaps = rng.gamma(spec.burstiness, 1.0 / (spec.request_rate * spec.burstiness), spec.num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """One request the load generator sends."""

    prompt: str
    """The user turn (chat) or the prompt text (completions)."""
    max_tokens: int | None = None
    """Its output length (None: LoadSpec.max_tokens), e.g. the length of the reply a dataset recorded."""


def sharegpt_load(count: int, seed: int, max_tokens: int, tokenizer, split: str = "heldout") -> list[LoadRequest]:
    """Requests sampled as `vllm bench serve` samples ShareGPT: the prompt is a conversation's opening
    human turn and the output length is its recorded reply's, in tokens, at most max_tokens. From the
    held-out split by default, so a serving benchmark never measures on training prompts. As vLLM
    does, replies under 4 tokens are skipped."""
    from specjax.data.sharegpt import sharegpt_requests

    requests = sharegpt_requests(split, "first")
    order = np.random.default_rng(seed).permutation(len(requests))
    out = []
    for i in order:
        length = len(tokenizer.encode(requests[i].reply, add_special_tokens=False))
        if length >= 4:
            out.append(LoadRequest(requests[i].messages[-1]["content"], min(length, max_tokens)))
        if len(out) == count:
            break
    return out


async def _one_request(client, url: str, request: LoadRequest, spec: LoadSpec) -> Outcome:
    prompt = request.prompt
    if spec.chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=request.max_tokens or spec.max_tokens, temperature=0, stream=True)
    started = time.perf_counter()
    outcome = Outcome(ok=False, status=0)
    last = None
    try:
        async with client.stream("POST", url.rstrip("/") + path, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = (await response.aread()).decode(errors="replace")[:200]
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = event["error"].get("message", "error")
                    return outcome
                now = time.perf_counter()
                choice = event["choices"][0] if event.get("choices") else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text:
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - started
                    elif last is not None:
                        outcome.gaps_s.append(now - last)
                    last = now
                if event.get("usage"):
                    outcome.output_tokens = event["usage"]["completion_tokens"]
        outcome.e2el_s = time.perf_counter() - started
        outcome.ok = outcome.ttft_s is not None or outcome.output_tokens == 0
    except Exception as error:  # noqa: BLE001 - a failed request is a measurement, not a crash
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


KV_GAUGE = "specjax:kv_cache_bytes_in_use"
"""The server gauge bench-serve samples while it loads the server (target and drafter parts summed)."""


async def _scrape_kv_bytes(client, url: str) -> float | None:
    """The server's KV bytes in use from its /metrics, or None (no such gauge, or no answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get(f"{url.rstrip('/')}/metrics")
        families = text_string_to_metric_families(response.text) if response.status_code == 200 else []
        values = [s.value for f in families if f.name == KV_GAUGE for s in f.samples]
    except Exception:  # noqa: BLE001 - a missed scrape is a missing sample, not a failed run
        return None
    return float(sum(values)) if values else None


async def _sample_kv_bytes(client, url: str, samples: list[float], every_s: float = 0.5) -> None:
    """Scrape the server's KV bytes in use every every_s seconds into samples."""
    while True:
        value = await _scrape_kv_bytes(client, url)
        if value is not None:
            samples.append(value)
        await asyncio.sleep(every_s)


async def run_load(url: str, prompts: list[str | LoadRequest], spec: LoadSpec,
                   kv_samples: list[float] | None = None) -> list[Outcome]:
    """Send spec.num_requests requests (prompts cycled) on the arrival schedule; return every outcome.
    A prompt is text (output length spec.max_tokens) or a LoadRequest with its own length.
    kv_samples: if given, the server's KV bytes in use are sampled into it during the run."""
    import httpx

    check_loopback(url)
    if not prompts:
        raise SpecjaxError("no prompts to send")
    limit = spec.max_concurrency or spec.num_requests
    gate = asyncio.Semaphore(limit)
    times = arrival_times(spec)
    began = time.perf_counter()
    # One connection more than the requests may hold: the KV sampler's scrapes never queue a request.
    connections = limit + (kv_samples is not None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.time_limit_s), limits=httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections)) as client:

        async def scheduled(i: int) -> Outcome:
            await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - began)))
            async with gate:
                prompt = prompts[i % len(prompts)]
                request = prompt if isinstance(prompt, LoadRequest) else LoadRequest(prompt)
                return await _one_request(client, url, request, spec)

        tasks = [asyncio.ensure_future(scheduled(i)) for i in range(spec.num_requests)]
        sampler = None if kv_samples is None else asyncio.ensure_future(_sample_kv_bytes(client, url, kv_samples))
        done, pending = await asyncio.wait(tasks, timeout=spec.time_limit_s)
        for task in pending | ({sampler} if sampler else set()):
            task.cancel()
        if kv_samples is not None:  # one scrape at the end too, so a burst shorter than the period counts
            value = await _scrape_kv_bytes(client, url)
            if value is not None:
                kv_samples.append(value)
        return [t.result() if t in done else Outcome(False, 0, error="time limit") for t in tasks]


def _percentiles(values) -> dict:
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99))}


def summarize(outcomes: list[Outcome], wall_s: float, goodput: dict[str, float] | None = None) -> dict:
    """vllm-bench-serve-style summary. goodput: SLOs in ms, keys among ttft, tpot, e2el."""
    ok = [o for o in outcomes if o.ok]
    tpot = [(o.e2el_s - o.ttft_s) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1 and o.ttft_s is not None]
    summary = {
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "rejected_429": sum(o.status == 429 for o in outcomes),
        "duration_s": wall_s,
        "request_throughput": len(ok) / wall_s,
        "output_token_throughput": sum(o.output_tokens for o in ok) / wall_s,
        "ttft_ms": _percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([g for o in ok for g in o.gaps_s]),
        "e2el_ms": _percentiles([o.e2el_s for o in ok]),
    }
    if goodput:
        def meets(o: Outcome) -> bool:
            values = {"ttft": o.ttft_s, "e2el": o.e2el_s,
                      "tpot": (o.e2el_s - o.ttft_s) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0}
            return all(values[k] is not None and values[k] * 1e3 <= limit for k, limit in goodput.items())
        summary["goodput"] = sum(meets(o) for o in ok) / wall_s
    else:
        summary["goodput"] = None
    return summary


def parse_goodput(text: str | None) -> dict[str, float]:
    """'ttft:500,tpot:100' -> {'ttft': 500.0, 'tpot': 100.0} (milliseconds)."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, _, value = part.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise SpecjaxError(f"--goodput takes ttft, tpot or e2el limits in ms, got {part!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise SpecjaxError(f"--goodput limit {part!r} is not a number of milliseconds") from None
    return out


def benchmark(url: str, prompts: list[str | LoadRequest], spec: LoadSpec, goodput: dict[str, float] | None = None) -> dict:
    began = time.perf_counter()
    kv_samples: list[float] = []
    outcomes = asyncio.run(run_load(url, prompts, spec, kv_samples))
    summary = summarize(outcomes, time.perf_counter() - began, goodput)
    # The server's KV bytes holding tokens, sampled twice a second under this load (None: no gauge).
    summary["kv_bytes_in_use"] = ({"mean": float(np.mean(kv_samples)), "max": float(np.max(kv_samples))}
                                  if kv_samples else None)
    summary["request_rate"] = None if math.isinf(spec.request_rate) else spec.request_rate
    summary["max_concurrency"] = spec.max_concurrency
    errors = [o.error for o in outcomes if not o.ok and o.error]
    summary["first_errors"] = errors[:3]
    return summary


def plot_sweep(rows: list[dict], path: str) -> None:
    """Latency percentiles and throughput against request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["request_rate"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        for pct, style in (("p50", "-o"), ("p99", "--o")):
            left.plot(rates, [r[key][pct] for r in rows], style, label=f"{label} {pct}")
    left.set_xlabel("request rate (requests/s)")
    left.set_ylabel("latency (ms)")
    left.set_yscale("log")
    left.legend()
    right.plot(rates, [r["output_token_throughput"] for r in rows], "-o", label="output tokens/s")
    right.set_xlabel("request rate (requests/s)")
    right.set_ylabel("output tokens/s")
    right.legend()
    fig.suptitle("specjax bench-serve: latency and throughput against load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
