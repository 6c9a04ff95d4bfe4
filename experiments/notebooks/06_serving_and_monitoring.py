# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Serving a burst, and watching it
#
# `specjax serve` puts a **continuous-batching scheduler** behind an OpenAI-compatible API: one
# thread owns a fixed set of decode slots, prefills waiting requests into free slots, runs a few
# verify steps for every occupied slot in one device call, streams the new tokens and frees a slot
# the moment its request ends. An **adaptive controller** (issue 16) picks, before every device
# call, which precompiled policy runs it: autoregressive (`ar`, 0 drafts), or a drafter chain that
# verifies `chain:K` drafts (`chain` = the whole block). It predicts committed tokens per second
# from the acceptance it has measured and the cost of each policy at the current batch, switches
# only when a challenger wins by a margin several times in a row, and now and then **probes** a
# policy it has not run lately.
#
# Here the scheduler runs in this process (no HTTP), SmolLM2-135M with its committed drafter. We
# send a burst of held-out chat prompts at once and plot, in seconds since the burst:
# - **tau**, the tokens a request commits per verify step, over each interval;
# - **KV memory** (MiB) that live requests hold;
# - **latency**: each request's time to first token (TTFT) and time per output token (TPOT);
#
# with the controller's choices (which policy, so which draft length, and when) marked on every
# plot. The numbers come from the scheduler's own history: its run log (what
# `specjax serve --metrics-log` writes and `specjax report` plots), whose snapshots are read from
# the same metrics registry that `/metrics` exports and `specjax top` shows. Last, every greedy
# served output is compared with autoregressive decoding of the same prompt.

# %%
# Install specjax from the checkout this notebook sits in; elsewhere (Colab) from SPECJAX_REPO.
SPECJAX_REPO = "git+https://github.com/specjax/specjax"  # your fork, if you have one
import importlib.util, pathlib, subprocess, sys  # noqa: E401
if importlib.util.find_spec("specjax") is None:
    here = pathlib.Path.cwd().resolve()
    root = next((d for d in (here, *here.parents) if (d / "pyproject.toml").exists() and (d / "specjax").is_dir()), None)
    source = ["-e", str(root)] if root else [SPECJAX_REPO]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *source], check=True)
    print("installed specjax from", source[-1])
from specjax.notebook import setup  # noqa: E402
ENV = setup()

# %% tags=["parameters"]
REQUESTS = 16                # held-out chat prompts sent at once (the 12 prompts, cycled)
MAX_NEW_TOKENS = 64          # new tokens per request (greedy)
SLOTS = 8                    # requests decoding at once; the rest wait in the queue
POLICIES = ("ar", "chain:3", "chain:7", "chain")  # what the controller chooses among (each compiles once)
PROBE_EVERY = 12             # device calls between probes of a policy not run lately (the server's default: 48)
CHECK_AR = True              # decode every prompt autoregressively too, and compare

# %%
import tempfile
import threading
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import specjax
from specjax.notebook import summary

llm = specjax.LLM("smollm2", dtype=ENV.dtype, refiner=None)
texts = [specjax.HELDOUT_CHAT_PROMPTS[i % len(specjax.HELDOUT_CHAT_PROMPTS)] for i in range(REQUESTS)]
prompts = [llm.encode(t) for t in texts]
block = llm.drafter.config.block_size
# Every slot holds its prompt, its answer and one verify step's writes. At these sizes that is at
# most 128 cache slots: a single attention length, so every step shape is compiled at start-up.
context = max(map(len, prompts)) + MAX_NEW_TOKENS + block + 1
run_dir = tempfile.TemporaryDirectory()
run_log = Path(run_dir.name) / "run.jsonl"
started = time.perf_counter()
# compile_now=False: each policy's step is compiled (and timed, for the controller) here; the
# prefill compiles on first use, so the warm-up below runs it before the burst.
scheduler = llm.server(SLOTS, "adaptive", metrics_log=str(run_log), compile_now=False, context_length=context,
                       max_new_tokens=MAX_NEW_TOKENS, steps_per_sync=4,
                       controller=specjax.ControllerConfig(policies=POLICIES, probe_every=PROBE_EVERY),
                       snapshot_every=0.05)  # a snapshot after (nearly) every device call
config = scheduler.config
print(f"{SLOTS} slots of {config.context_length} tokens; policies {', '.join(scheduler.policies)} "
      f"(block {block}: chain verifies {block - 1} drafts); ready in {time.perf_counter() - started:.1f} s")
print("start-up cost of one call (4 steps), by live rows:")
for policy in scheduler.policies:
    costs = {rows: scheduler.controller.startup_s[policy, rows] for rows in scheduler.shapes.row_buckets}
    print(f"  {policy:>8}: " + ", ".join(f"{rows} rows {1e3 * s:.0f} ms" for rows, s in costs.items()))

# %% [markdown]
# ## Warm-up, then the burst
# One token for every prompt first (a request of one token ends at its prefill), so the prefill is
# compiled for one and for several rows before the clock starts. Then all requests arrive at
# once: `SLOTS` of them start decoding and the others queue, entering slots as earlier ones finish.
#
# The scheduler asks its controller before every device call and keeps each answer (the policy,
# why, and the tokens per second it predicted for every policy) with the time it was given, in
# `scheduler.decisions`. Probes come every `PROBE_EVERY` calls here (the server's default is 48),
# so that a short burst shows some.

# %%
try:
    for handle in [scheduler.submit(specjax.Request(tuple(p), max_tokens=1)) for p in prompts]:  # several rows at once
        handle.result(timeout=600)
    scheduler.submit(specjax.Request(tuple(prompts[0]), max_tokens=1)).result(timeout=600)  # and one alone

    burst_at = time.time()  # wall clock, as the run log records it
    handles = [scheduler.submit(specjax.Request(tuple(p), max_tokens=MAX_NEW_TOKENS, temperature=0.0))
               for p in prompts]
    results = [h.result(timeout=1200) for h in handles]
    burst_s = time.time() - burst_at
    # What `specjax top` shows from /metrics, read from the same registry (counters since start-up).
    top = scheduler.live_view()
finally:
    scheduler.shutdown(timeout=60)  # drains (cancels what is left after 60 s), stops its thread, closes the run log
left = [t.name for t in threading.enumerate() if t.name.startswith("specjax")]
print(f"{len(results)} requests, {sum(len(r.token_ids) for r in results)} tokens in {burst_s:.1f} s; "
      f"finish reasons {sorted({r.finish_reason for r in results})}")
print(f"scheduler shut down; specjax threads still running: {left or 'none'}")
print(f"as `specjax top` shows it: policy {top['policy']}, switches {top['switches'] or 'none'}, "
      f"tau overall {top['tau_overall'] or float('nan'):.2f}, TTFT p50 {1e3 * top['ttft'][.5]:.0f} ms, ITL p50 "
      f"{1e3 * top['itl'][.5]:.0f} ms (histogram estimates since start-up, warm-up included)")

# %% [markdown]
# ## The run, over time
# The run log holds a snapshot of the live signals after every device call (or every 50 ms, when
# calls are faster): tau over the interval since the previous snapshot, KV bytes, the queue; and
# one record per finished request (its TTFT, end-to-end time and token count). The coloured bands
# are the device calls, coloured by the policy the controller chose for each (white: prefills and
# host work between calls). AR calls verify no drafts, so tau has no value there: AR commits
# exactly one token per step.

# %%
snapshots, records = specjax.read_run_log(run_log)
snapshots = [s for s in snapshots if s["time"] >= burst_at]
records = [r for r in records if r["time"] >= burst_at and r.get("e2e_s") is not None]
lat = specjax.request_latencies(records)
snap_end = np.array([s["time"] - burst_at for s in snapshots])
snap_start = np.maximum(snap_end - np.array([s["interval_s"] for s in snapshots]), 0.0)
calls = [(t - burst_at, d) for t, d in scheduler.decisions if t >= burst_at]
call_start = np.array([t for t, _ in calls])
# A call ends at the first snapshot after it (written once its tokens are synced), or at the next
# decision if that comes first.
call_end = np.array([min([*snap_end[snap_end > t][:1], *call_start[i + 1: i + 2]], default=t)
                     for i, t in enumerate(call_start)])
ran = [d.policy for _, d in calls]
order = [p for p in scheduler.policies if p in ran]
colours = dict(zip(scheduler.policies, plt.cm.Set2.colors))
drafts = {p: scheduler.controller.drafts[p] for p in scheduler.policies}
label = lambda p: f"{p} ({drafts[p]} drafts)" if drafts[p] is not None else p  # noqa: E731

fig, (tau_ax, kv_ax, lat_ax, pred_ax, pol_ax) = plt.subplots(
    5, 1, figsize=(11, 14), sharex=True, gridspec_kw={"height_ratios": [2, 2, 2.4, 2, 1]})
for ax in (tau_ax, kv_ax, lat_ax, pred_ax):
    for a, b, p in zip(call_start, call_end, ran):
        ax.axvspan(a, b, color=colours[p], alpha=0.35, lw=0)
    ax.grid(alpha=0.3)

tau = np.array([np.nan if s["tau"] is None else s["tau"] for s in snapshots])
tau_ax.hlines(tau, snap_start, snap_end, color="black", lw=2)
tau_ax.plot(snap_end, tau, "o", color="black", ms=3, label="tau over a snapshot's interval")
tau_ax.axhline(1.0, color="gray", ls=":", lw=1)
tau_ax.set(ylim=(0.95, 1.25 * max(np.nanmax(tau, initial=1.0), 1.0)), ylabel="tokens per verify step\n(per request)",
           title="Acceptance length tau (speculative calls; AR commits 1 token per step)")
tau_ax.legend(fontsize=8, loc="upper right")

# The state after each snapshot, from the burst on (at the burst every request waits and no KV is held).
t_state = np.concatenate([[0.0], snap_end])
mib = lambda part: np.array([0.0] + [s["kv_bytes"].get(part, 0.0) / 2**20 for s in snapshots])  # noqa: E731
parts = [p for p in ("target", "drafter") if any(p in s["kv_bytes"] for s in snapshots)]
kv_ax.stackplot(t_state, [mib(p) for p in parts], step="post", alpha=0.8, colors=["slategray", "darkgoldenrod"],
                labels=["target KV cache", "drafter context"][: len(parts)])
kv_top = max([sum(v) for v in zip(*[mib(p) for p in parts])], default=0.0)
kv_ax.set(ylabel="MiB held by live requests", title="KV memory, and the queue", ylim=(0, 1.4 * kv_top + 1e-3))
queue_ax = kv_ax.twinx()
running = [0] + [s["running"] for s in snapshots]
waiting = [REQUESTS] + [s["waiting"] for s in snapshots]
queue_ax.step(t_state, running, where="post", color="black", lw=1.2, label="decoding")
queue_ax.step(t_state, waiting, where="post", color="black", ls="--", lw=1.2, label="waiting")
queue_ax.set(ylabel="requests", ylim=(-0.3, 1.4 * REQUESTS))
queue_ax.yaxis.get_major_locator().set_params(integer=True)
lines, names = kv_ax.get_legend_handles_labels()
more = queue_ax.get_legend_handles_labels()
kv_ax.legend(lines + more[0], names + more[1], fontsize=8, loc="upper right")

first = lat["arrival"] - burst_at + lat["ttft"]  # when each request's first token arrived
finish = lat["finish"] - burst_at
lat_ax.plot(first, lat["ttft"] * 1e3, "s", color="tab:red", label="TTFT, at the request's first token")
lat_ax.hlines(lat["tpot"] * 1e3, first, finish, color="tab:purple", lw=2,
              label="TPOT, from the request's first token to its last")
lat_ax.set_yscale("log")
lat_ax.set(ylabel="ms", title="Latency of each request")
lat_ax.legend(fontsize=8, loc="upper right")

for p in order:
    pred_ax.plot(call_start, [d.predicted_tokens_per_s.get(p, np.nan) for _, d in calls], ".-", ms=4,
                 color=colours[p], label=f"{p}: predicted", lw=1.2)
for reason, marker in (("probe", "v"), ("faster", "*"), ("ready", "D"), ("pinned", "P")):
    picked = [(t, d.predicted_tokens_per_s.get(d.policy, np.nan)) for t, d in calls if d.reason == reason]
    if picked:
        pred_ax.plot(*zip(*picked), marker, color="black", ms=8, ls="none", label=f"{reason}: chose it")
pred_ax.set(ylabel="committed tokens / s", title="What the controller predicted for each policy, at each call")
pred_ax.legend(fontsize=8, loc="upper right", ncol=2)

for i, p in enumerate(order):
    spans = [(a, b - a) for a, b, q in zip(call_start, call_end, ran) if q == p]
    pol_ax.broken_barh(spans, (i - 0.4, 0.8), color=colours[p])
pol_ax.set_yticks(range(len(order)), [label(p) for p in order])
pol_ax.set(xlabel="seconds since the burst", title="Policy of each device call", xlim=(0, burst_s * 1.01))
plt.tight_layout()
plt.show()

reasons = {}
for _, d in calls:
    reasons[d.reason] = reasons.get(d.reason, 0) + 1
policy_calls = {p: ran.count(p) for p in order}
changes = [(call_start[i], ran[i - 1], ran[i], calls[i][1].reason) for i in range(1, len(ran)) if ran[i] != ran[i - 1]]
print(f"{len(calls)} device calls: {policy_calls}; decisions by reason: {reasons}")
print("policy changes: " + (", ".join(f"{a} -> {b} ({why}) at {t:.1f} s" for t, a, b, why in changes) or "none"))
run = specjax.summarize_run(snapshots, records)
print(f"tau {run['tau']:.2f}, TTFT p50 {1e3 * run['ttft_p50_s']:.0f} ms, TPOT p50 {1e3 * run['tpot_p50_s']:.0f} ms, "
      f"peak KV {run['kv_bytes_max'] / 2**20:.2f} MiB, {run['output_tokens_per_s']:.1f} output tokens/s")

# %% [markdown]
# ## Served output against autoregressive decoding
# Greedy speculative decoding commits exactly the target's greedy tokens, whatever policy each
# device call ran and whoever shared the batch. Each prompt is decoded again, autoregressively,
# by `llm.generate` and compared token for token.

# %%
if CHECK_AR:
    reference = [c.token_ids for c in llm.generate(prompts, MAX_NEW_TOKENS, method="ar")]
    same = [r.token_ids == want for r, want in zip(results, reference)]
    identical = all(same)
    print(f"served = AR for {sum(same)} of {len(same)} requests")
    if ENV.dtype != "float32":
        print(f"({ENV.dtype}: a row's rounding depends on the rows sharing its step, so a served greedy request "
              "can differ from the same prompt decoded alone)")
else:
    identical = None
print("prompt:", texts[0])
print("answer:", results[0].text.strip())

# %%
summary(requests=len(results), finished=sum(r.finish_reason in ("stop", "length") for r in results),
        tokens=sum(len(r.token_ids) for r in results), burst_s=burst_s, tau=run["tau"],
        kv_peak_mib=run["kv_bytes_max"] / 2**20, ttft_p50_ms=1e3 * run["ttft_p50_s"],
        tpot_p50_ms=1e3 * run["tpot_p50_s"], calls_by_policy=policy_calls, decisions_by_reason=reasons,
        policy_changes=len(changes), identical_to_ar=identical, threads_left=len(left))
