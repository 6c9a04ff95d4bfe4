"""Adaptive speculation: switching methods between steps, per-row draft limits, and the controller.

Exactness first: a slot batch whose method changes at random steps, with random per-row draft
limits, gives AR's greedy tokens, and its sampled rows follow the target's exact distribution (a
deliberately broken limit rule fails that check). Then the controller's decisions, on synthetic
signals and through a live scheduler.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

import numpy as np
import pytest

from specjax.decode import slots
from specjax.decode.engine import Engine
from specjax.decode.tree import TreeConfig
from specjax.errors import SpecjaxError

from stats import chi_square_pvalue
from test_decode import TINY
from test_speculative import SAMPLINGS, _exact_marginals

PROMPTS = [[1, 5, 2], [7], [4, 4, 9, 10, 11, 0, 2], [2, 2], [9, 1, 1, 1, 8], [6, 5]]
SWITCHED = ("ar", "chain", "chain:1", "chain:2", "tree")
"""Methods a switching test draws from (the tiny drafter's block is 4: 3 drafts)."""


def _statics(drafter, rows, depth, eos=(), tree=TreeConfig(budget=4)):
    """eos: () for sampling checks, whose exact marginals run past EOS."""
    return slots.SlotStatics(TINY, slots.SlotConfig(slots=rows, cache_length=64, max_new_tokens=depth,
                                                    steps_per_sync=1, insert_rows=rows), eos, drafter.config,
                             tree=tree)


def _insert(statics, parts, prompts, depth, sampling=None, seed=0, limits=None):
    rows = len(prompts)
    width = max(map(len, prompts))
    tokens = np.zeros((rows, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    full = lambda v, dt: jnp.full((rows,), v, dt)  # noqa: E731
    sampling = sampling or SAMPLINGS[0].__class__(temperature=0.0)
    request = slots.InsertRequest(
        rows=jnp.arange(rows, dtype=jnp.int32), prompts=jnp.asarray(tokens), prompt_lengths=jnp.asarray(
            [len(p) for p in prompts], jnp.int32), max_new_tokens=full(depth, jnp.int32),
        seeds=jnp.arange(rows, dtype=jnp.uint32) + seed * rows,
        sampling=slots.RowSampling(full(sampling.temperature, jnp.float32), full(sampling.top_k, jnp.int32),
                                   full(sampling.top_p, jnp.float32)),
        draft_limit=None if limits is None else jnp.asarray(limits, jnp.int32))
    return slots.insert(parts, slots.empty_slots(statics), request, statics=statics)


def test_chain_tiers_and_limits_are_checked():
    assert slots.slot_method("chain:2").drafts == 2
    with pytest.raises(SpecjaxError, match="unknown method"):
        slots.slot_method("chain:0")
    with pytest.raises(SpecjaxError, match="unknown method"):
        slots.slot_method("tree:2")


def test_switching_methods_at_random_steps_keeps_greedy_output_equal_to_ar(target, drafter):
    """Each step runs a method drawn at random, and each row has a random draft limit (0 makes it
    decode one token per step inside a speculative step): the tokens are AR's, and the drafter's
    context stays whole through AR steps (speculative steps after them still accept drafts)."""
    depth = 24
    statics = _statics(drafter, len(PROMPTS), depth, eos=tuple(target.eos_token_ids))
    parts = slots.slot_parts(statics, target.params, drafter.params)
    rng = np.random.default_rng(0)
    limits = [0, 3, 1, 2, 3, 3]
    state = _insert(statics, parts, PROMPTS, depth, limits=limits)
    methods = []
    while not bool(state.done.all()):
        methods.append(SWITCHED[rng.integers(len(SWITCHED))])
        state = slots.step(parts, state, method=methods[-1], statics=statics)
    assert len(set(methods)) == len(SWITCHED)
    expected = Engine(target).generate(PROMPTS, depth).tokens
    tokens, counts = np.asarray(state.tokens), np.asarray(state.num_generated)
    for row, want in enumerate(expected):
        assert tokens[row, : counts[row]].tolist() == want, (row, methods)
    histogram = np.asarray(state.accepted_histogram)
    assert histogram[0, 1:].sum() == 0  # the limit-0 row never committed a draft
    assert histogram[1:, 1:].sum() > 0  # the others did, after AR steps too


def test_a_windowed_drafter_reads_only_its_window_and_output_stays_ar(target, drafter):
    """Memory pressure's windowing: rows whose drafter is windowed in the middle of a request
    (SlotState.drafter_window) keep AR's greedy tokens under switching methods, and go on
    accepting drafts. The drafter reads nothing before the window: garbling every context entry
    older than it leaves the drafts as they were, and changes them when the row is not windowed."""
    from specjax.decode.speculative import draft_block_states
    from specjax.models.cache import KVCache

    depth, window = 24, 3
    statics = _statics(drafter, len(PROMPTS), depth, eos=tuple(target.eos_token_ids))
    parts = slots.slot_parts(statics, target.params, drafter.params)
    state = _insert(statics, parts, PROMPTS, depth)
    for method in ("chain", "tree"):
        state = slots.step(parts, state, method=method, statics=statics)
    windowed = jnp.asarray([window, 0, window, 0, window, window], jnp.int32)
    state = state.replace(drafter_window=windowed)

    cache, lengths = state.context_cache, state.lengths
    is_windowed = np.asarray(windowed) > 0
    # [S, T]: context before the window of each windowed row
    older = (jnp.arange(cache.max_length)[None, :] < (lengths - window)[:, None]) & is_windowed[:, None]
    garble = lambda c: jnp.where(older[:, :, None, None], 7.0, c)  # noqa: E731
    garbled = KVCache(tuple(map(garble, cache.keys)), tuple(map(garble, cache.values)))
    assert bool(older.any(axis=1)[is_windowed].all())  # every windowed row has context before its window

    def drafted(context, context_from):
        return np.asarray(draft_block_states(target.params, TINY, drafter.params, drafter.config, state.last_token,
                                             lengths, context, context_from=context_from))
    context_from = slots._context_from(state, lengths)
    np.testing.assert_allclose(drafted(garbled, context_from), drafted(cache, context_from), atol=1e-6)
    changed = np.abs(drafted(garbled, None) - drafted(cache, None)).max(axis=(1, 2))  # [S]
    assert (changed[is_windowed] > 1e-3).all(), changed

    rng = np.random.default_rng(1)
    while not bool(state.done.all()):
        state = slots.step(parts, state, method=SWITCHED[rng.integers(len(SWITCHED))], statics=statics)
    expected = Engine(target).generate(PROMPTS, depth).tokens
    tokens, counts = np.asarray(state.tokens), np.asarray(state.num_generated)
    for row, want in enumerate(expected):
        assert tokens[row, : counts[row]].tolist() == want, row
    assert np.asarray(state.accepted_histogram)[is_windowed, 1:].sum() > 0  # windowed rows still accept


def _switched_samples(target, drafter, sampling, prompt, count, depth, seed, methods, limits):
    statics = _statics(drafter, count, depth)
    parts = slots.slot_parts(statics, target.params, drafter.params)
    state = _insert(statics, parts, [prompt] * count, depth, sampling, seed, limits)
    for method in methods:
        if bool(state.done.all()):
            break
        state = slots.step(parts, state, method=method, statics=statics)
    assert bool(state.done.all())
    return np.asarray(state.tokens[:, :depth]), np.asarray(state.accepted_histogram)


def _forced_switching_pvalues(target, drafter, seed):
    sampling, prompt, depth, count = SAMPLINGS[0], [1, 5, 2], 3, 10_000
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth)
    methods = ["chain:1", "ar", "tree", "chain", "chain:2", "chain"]
    limits = np.random.default_rng(seed).integers(0, 4, count)
    out, histogram = _switched_samples(target, drafter, sampling, prompt, count, depth, seed, methods, limits)
    assert 0.05 < histogram[:, 1:].sum() / histogram.sum() < 0.99  # drafts both accepted and rejected
    return [chi_square_pvalue(np.bincount(out[:, i], minlength=TINY.vocab_size), exact[i]) for i in range(depth)]


def test_forced_switching_and_row_limits_sample_the_exact_target_distribution(target, drafter):
    """Methods switched between steps and per-row limits of 0-3 drafts keep every position's
    marginal the target's."""
    for position, pvalue in enumerate(_forced_switching_pvalues(target, drafter, seed=11)):
        assert pvalue > 1e-3, f"token {position + 1}: p = {pvalue}"


def test_a_broken_limit_rule_fails_the_distribution_check(target, drafter, monkeypatch):
    """Cutting at the limit but taking the last kept draft as the next token (instead of the draft
    the rule emitted after it) repeats a token: the check sees it."""
    def broken(n, next_token, drafts, limit):
        cut = n > limit
        previous = jnp.take_along_axis(drafts, jnp.clip(limit - 1, 0, drafts.shape[1] - 1)[:, None], axis=1)[:, 0]
        return jnp.minimum(n, limit), jnp.where(cut & (limit > 0), previous, next_token)

    monkeypatch.setattr(slots, "_within_limit", broken)
    jax.clear_caches()
    try:
        pvalues = _forced_switching_pvalues(target, drafter, seed=12)
    finally:
        jax.clear_caches()
    assert min(pvalues) < 1e-6, pvalues


# ---- the controller, on synthetic signals ----

from specjax.serve.controller import Controller, ControllerConfig  # noqa: E402

BLOCK = 8
BATCH_ONE = {"ar": 1.0, "chain:3": 1.3, "chain": 1.4}
"""Seconds per call at one row: verifying a block costs little more than one token."""
FULL_BATCH = {"ar": 1.0, "chain:3": 3.5, "chain": 7.0}
"""At a full batch verification is no longer cheap."""


def _controller(**kw) -> Controller:
    kw.setdefault("probe_every", 0)
    controller = Controller(("ar", "chain:3", "chain"), BLOCK, ControllerConfig(**kw))
    for policy in controller.policies:
        controller.mark_ready(policy, {1: BATCH_ONE[policy], 32: FULL_BATCH[policy]})
    return controller


def _observe_chain(controller, rate, steps=100, rows=1, seconds=None, policy="chain"):
    """A call of `policy` whose every draft position is accepted with probability `rate`."""
    drafts = controller.drafts[policy]
    verified = np.array([steps * rate**j if j < drafts else 0 for j in range(BLOCK - 1)])
    reached = np.array([steps * rate ** (j + 1) if j < drafts else 0 for j in range(BLOCK - 1)])
    committed = steps + reached.sum()
    table = BATCH_ONE if rows == 1 else FULL_BATCH
    controller.observe_call(policy, rows, 128, seconds or table[policy], steps, committed, reached, verified)


def test_the_controller_picks_the_longest_chain_at_batch_one_and_ar_at_a_full_batch():
    controller = _controller()
    assert controller.current == "chain"  # the start: the longest chain, which measures every position
    _observe_chain(controller, 0.8)
    assert controller.tokens_per_row_step("chain") == pytest.approx(1 + sum(0.8**i for i in range(1, 8)))
    assert controller.tokens_per_row_step("chain", limit=0) == 1.0
    assert controller.decide(1, 128, [None]).policy == "chain"
    decisions = [controller.decide(32, 128, [None] * 32) for _ in range(3)]
    # Dropped within `patience` decisions once it stops paying, not at the first.
    assert [d.policy for d in decisions] == ["chain", "chain", "ar"], decisions
    assert decisions[-1].reason == "faster" and controller.switches == {"faster": 1}
    values = decisions[-1].predicted_tokens_per_s
    assert values["ar"] == pytest.approx(32 / 1.0) and values["chain"] == pytest.approx(32 * 4.16 / 7.0, rel=0.01)


def test_with_a_tpot_slo_the_controller_maximises_goodput():
    """Under a TPOT SLO the objective is goodput, the tokens/s of rows predicted to meet it. Half the
    rows opted out of speculation and commit one token per chain step, slower than the SLO: the
    chain serves more tokens in all, AR more tokens within the SLO."""
    tau = 1 + sum(0.8**i for i in range(1, 8))

    def decided(slo):
        controller = Controller(("ar", "chain"), BLOCK, ControllerConfig(probe_every=0, patience=1, tpot_slo_s=slo))
        controller.mark_ready("ar", {32: 1.0})
        controller.mark_ready("chain", {32: 2.2})
        _observe_chain(controller, 0.8, rows=32, seconds=2.2)
        return controller.decide(32, 128, [None] * 16 + [0] * 16)

    free = decided(None)
    assert free.policy == "chain"
    assert free.predicted_tokens_per_s["chain"] == pytest.approx((16 * tau + 16) / 2.2, rel=0.01)
    bound = decided(1.2)
    assert bound.policy == "ar" and bound.predicted_tokens_per_s["ar"] == pytest.approx(32.0)
    assert bound.predicted_tokens_per_s["chain"] == pytest.approx(16 * tau / 2.2, rel=0.01)
    with pytest.raises(SpecjaxError, match="tpot_slo_s"):
        ControllerConfig(tpot_slo_s=0.0)


def test_rows_that_opted_out_count_one_token_per_step():
    controller = _controller()
    _observe_chain(controller, 0.9)
    # Most rows limited to 0 drafts: speculation cannot pay for its verify cost at batch one either.
    decision = controller.decide(1, 128, [0])
    assert decision.predicted_tokens_per_s["ar"] > decision.predicted_tokens_per_s["chain"]


def test_noise_near_a_tie_does_not_make_the_controller_thrash():
    """Two policies within 3% of each other, measured costs jittering by 5%: hysteresis holds."""
    controller = _controller(patience=3, margin=0.08)
    rng = np.random.default_rng(0)
    _observe_chain(controller, 0.5)
    # chain:3 predicts 1.875 tokens at 1.3 s; make chain's cost give nearly the same value.
    tie = controller.tokens_per_row_step("chain") / controller.tokens_per_row_step("chain:3") * 1.3 * 1.03
    controller.startup_s["chain", 1] = tie
    for _ in range(200):
        policy = controller.decide(1, 128, [None]).policy
        _observe_chain(controller, 0.5, seconds=controller.startup_s[policy, 1] * rng.uniform(0.95, 1.05),
                       policy=policy)
    assert sum(controller.switches.values()) <= 1, controller.switches


def test_near_a_tie_the_controller_settles_on_less_speculation():
    """A 4% predicted lead moves the controller from the chain to AR (margin_to_fewer, 0 by
    default), but not from AR back to the chain (margin, 8%)."""
    controller = _controller(patience=3, margin=0.08)
    _observe_chain(controller, 0.5)
    chain = controller.predicted(1, 128, [None])["chain"]
    controller.startup_s["ar", 1] = 1.0 / (1.04 * chain / controller.steps_per_call)  # AR predicted 4% ahead
    decisions = [controller.decide(1, 128, [None]).policy for _ in range(3)]
    assert decisions == ["chain", "chain", "ar"], decisions
    controller.startup_s["ar", 1] = 1.0 / (chain / 1.04 / controller.steps_per_call)  # now the chain is 4% ahead
    assert {controller.decide(1, 128, [None]).policy for _ in range(10)} == {"ar"}
    # A margin_to_fewer as large as the margin restores symmetric hysteresis; one above it is refused.
    symmetric = _controller(patience=1, margin=0.08, margin_to_fewer=0.08)
    _observe_chain(symmetric, 0.5)
    symmetric.startup_s["ar", 1] = 1.0 / (1.04 * symmetric.predicted(1, 128, [None])["chain"])
    assert {symmetric.decide(1, 128, [None]).policy for _ in range(5)} == {"chain"}
    with pytest.raises(SpecjaxError, match="margin_to_fewer"):
        ControllerConfig(margin=0.05, margin_to_fewer=0.1)


def test_measured_slowdowns_refit_the_costs_online():
    controller = _controller()
    _observe_chain(controller, 0.8)
    assert controller.decide(1, 128, [None]).policy == "chain"
    # The chain's calls turn out 4x slower than at start-up (say, another job took the cores' caches).
    for _ in range(10):
        _observe_chain(controller, 0.8, seconds=4 * BATCH_ONE["chain"])
    assert controller.seconds_per_call("chain", 1, 128) > 3 * BATCH_ONE["chain"]
    # The drift is per shape and shared, so every policy's prediction at it rose alike: no switch.
    assert controller.decide(1, 128, [None]).policy == "chain"


def test_stale_policies_are_probed_and_pins_win():
    controller = _controller(probe_every=5)
    _observe_chain(controller, 0.8)
    probes = []
    for _ in range(24):
        decision = controller.decide(1, 128, [None])
        probes.append(decision.reason)
        _observe_chain(controller, 0.8, policy=decision.policy) if decision.policy != "ar" else \
            controller.observe_call("ar", 1, 128, 1.0, 100, 100, np.zeros(BLOCK - 1), np.zeros(BLOCK - 1))
    assert probes.count("probe") >= 2 and controller.current == "chain"
    controller.pin("ar")
    assert controller.decide(1, 128, [None]).policy == "ar"
    with pytest.raises(SpecjaxError, match="not compiled"):
        controller.pin("tree")


def test_the_memory_alarm_projects_growth_before_the_budget():
    controller = Controller(("ar",), 1, ControllerConfig(kv_budget_bytes=1000, kv_horizon_s=3.0, ema=1.0))
    assert not controller.observe_memory(100, 0.0).alarm
    state = controller.observe_memory(300, 1.0)  # +200 B/s: 3.5 s to the budget
    assert not state.alarm and state.seconds_to_budget == pytest.approx(3.5)
    state = controller.observe_memory(500, 2.0)  # 2.5 s: inside the horizon, still under 90%
    assert state.alarm and state.bytes_in_use < 900
    assert controller.observe_memory(950, 100.0).alarm  # past the high water mark, growing or not


# ---- the adaptive server ----

from specjax.serve.scheduler import Request, Scheduler, ServeConfig  # noqa: E402


def _adaptive(target, drafter, slot_count=3, tree=TreeConfig(), latency_cache=None, metrics_log=None,
              snapshot_every=1.0, preemption="park", compile_rest="before_ready", **controller):
    controller.setdefault("remember", False)  # no acceptance carried from one test (or run) to the next
    config = ServeConfig(method="adaptive", slots=slot_count, context_length=64, max_new_tokens=24, steps_per_sync=2,
                         prompt_bucket=16, controller=ControllerConfig(**controller), tree=tree,
                         snapshot_every=snapshot_every, preemption=preemption, compile_rest=compile_rest)
    return Scheduler(target, drafter, config, compile_now=False, latency_cache=latency_cache, metrics_log=metrics_log)


def test_an_adaptive_server_switches_mid_request_and_stays_exact(target, drafter):
    """Probes every other call make the batch's policy change under running requests; one request
    opts out of speculation, one asks for chain:1 and one for ar: every output is AR's."""
    scheduler = _adaptive(target, drafter, probe_every=2, patience=1, margin=0.0)
    assert scheduler.policies == ("ar", "chain") and scheduler.controller.ready == {"ar", "chain"}
    overrides = [dict(), dict(speculation=False), dict(method="chain:1"), dict(method="ar"), dict(), dict()]
    limits = [24, 20, 17, 24, 9, 24]
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=n, temperature=0.0, **o))
                   for p, n, o in zip(PROMPTS, limits, overrides)]
        results = [h.result(timeout=300) for h in handles]
        with pytest.raises(SpecjaxError, match="not served here"):
            scheduler.submit(Request((1, 2), max_tokens=4, method="tree"))
        text = scheduler.metrics.prometheus_text()
    finally:
        scheduler.shutdown()
    expected = Engine(target).generate(PROMPTS, max(limits)).tokens
    for result, whole, limit in zip(results, expected, limits):
        assert result.token_ids == whole[:limit]
    metrics = [r.metrics for r in results]
    assert any(len(m["policy_steps"]) == 2 for m in metrics), [m["policy_steps"] for m in metrics]
    assert metrics[1]["speculation"] is False and metrics[1]["draft_limit"] == 0
    assert sum(metrics[1]["speculative_decoding"]["acceptance_histogram"][1:]) == 0
    assert metrics[2]["draft_limit"] == 1 and metrics[2]["method_requested"] == "chain:1"
    assert sum(metrics[2]["speculative_decoding"]["acceptance_histogram"][2:]) == 0
    assert metrics[3]["draft_limit"] == 0
    assert all(m["distinct_2"] is None or 0 < m["distinct_2"] <= 1 for m in metrics)
    assert 'specjax:policy_switches_total{reason="probe"}' in text
    assert "specjax:controller_predicted_tokens_per_step" in text and 'specjax:output_distinct_n{n="2"}' in text


@pytest.mark.parametrize("relief_window, preemption", [(None, "recompute"), (4, "park")])
def test_kv_pressure_windows_or_drops_then_preempts_and_outputs_stay_exact(target, drafter, tmp_path, relief_window,
                                                                           preemption):
    """A budget of 40 tokens' target KV for three requests that grow to about 30 tokens each: with a
    relief window the drafters are windowed to their last 4 positions first; without one drafter
    states go first; then the newest rows are preempted, parked on the host and written back (or
    recomputed from their tokens so far), and every greedy output is still AR's. The run log's
    report shows the budget, the windows or the drops, and the preemptions."""
    from specjax.decode.memory import target_kv_bytes
    from specjax.monitor.report import plot_report, read_run_log, summarize

    per_token = target_kv_bytes(TINY, 1, 1)
    log = tmp_path / "run.jsonl"
    scheduler = _adaptive(target, drafter, kv_budget_bytes=40 * per_token, kv_high_water=0.9, probe_every=0,
                          relief_window=relief_window, metrics_log=log, snapshot_every=0.01, preemption=preemption)
    limits = [24, 24, 24]
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=n, temperature=0.0))
                   for p, n in zip(PROMPTS[2:5], limits)]
        results = [h.result(timeout=300) for h in handles]
        text = scheduler.metrics.prometheus_text()
    finally:
        scheduler.shutdown()
    expected = Engine(target).generate(PROMPTS[2:5], max(limits)).tokens
    for result, whole, limit in zip(results, expected, limits):
        assert result.token_ids == whole[:limit]
    assert sum(r.metrics["preemptions"] for r in results) >= 1
    # A parked request is written back, not prefilled again; a recomputed one prefills its prompt again.
    prefilled = scheduler.metrics.registry.get_sample_value("specjax:prompt_tokens_total")
    prompt_tokens = sum(len(p) for p in PROMPTS[2:5])
    assert prefilled == prompt_tokens if preemption == "park" else prefilled > prompt_tokens
    dropped = sum(r.metrics["drafter_state_dropped"] for r in results)
    drops = scheduler.metrics.registry.get_sample_value("specjax:drafter_states_dropped_total")
    windows = scheduler.metrics.registry.get_sample_value("specjax:drafter_states_windowed_total")
    if relief_window is None:
        assert drops >= max(dropped, 1) and windows == 0
    else:  # windowing covers what dropping would, so the windowed rows keep speculating
        assert windows >= max(sum(r.metrics["drafter_windowed"] for r in results), 1)
        assert drops >= dropped
    assert "specjax:preemptions_total" in text and "specjax:kv_cache_budget_bytes" in text

    snapshots, requests = read_run_log(log)
    assert len(requests) == 3 and len(snapshots) >= 2
    summary = summarize(snapshots, requests)
    assert summary["preemptions"] == sum(r.metrics["preemptions"] for r in results)
    assert summary["drafter_states_dropped"] == drops  # (a request preempted after a drop resumes with a state)
    assert summary["drafter_states_windowed"] == windows
    assert summary["kv_budget"] == 40 * per_token and summary["kv_bytes_max"] > 0
    assert summary["completion_tokens"] == sum(limits)
    assert abs(sum(summary["policy_time_share"].values()) - 1) < 1e-9
    # The load the log shows: decoding or queued (preempted ones among them). Not decoding alone: how
    # long two rows decode side by side before a preemption is the host's timing.
    assert max(s["running"] + s["waiting"] for s in snapshots) >= 2
    png = plot_report(snapshots, requests, tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_that_does_not_fit_beside_a_running_one_waits(target, drafter):
    """Admission counts what the running requests hold: a 14-token prompt that would take a request
    of 24 prompt tokens past the budget's high water mark waits until that request finishes (at 34
    tokens), so nothing has to be windowed, dropped or preempted; both outputs are AR's. (The first
    request of an admission batch used to be let in unchecked.)"""
    import time

    from specjax.decode.memory import drafter_state_breakdown, target_kv_bytes

    # Both caches count: a token holds the target's K/V and the drafter's context entry.
    per_token = target_kv_bytes(TINY, 1, 1) + drafter_state_breakdown(drafter.config, 1, 64)["drafter_bytes_per_token"]
    scheduler = _adaptive(target, drafter, kv_budget_bytes=40 * per_token, kv_high_water=0.9, probe_every=0)
    long_prompt = tuple((i * 7 + 3) % TINY.vocab_size for i in range(24))
    prompts, limits = [long_prompt, tuple(PROMPTS[2]) + tuple(PROMPTS[4]) + tuple(PROMPTS[5])], [10, 6]
    try:
        first = scheduler.submit(Request(prompts[0], max_tokens=limits[0], temperature=0.0))
        deadline = time.perf_counter() + 120
        while scheduler.num_running == 0 and not first.done and time.perf_counter() < deadline:
            time.sleep(0.005)
        second = scheduler.submit(Request(prompts[1], max_tokens=limits[1], temperature=0.0))
        results = [first.result(timeout=300), second.result(timeout=300)]
        registry = scheduler.metrics.registry
        relief = {name: registry.get_sample_value(f"specjax:{name}_total")
                  for name in ("preemptions", "drafter_states_dropped", "drafter_states_windowed")}
    finally:
        scheduler.shutdown()
    assert relief == {"preemptions": 0, "drafter_states_dropped": 0, "drafter_states_windowed": 0}, relief
    expected = Engine(target).generate([list(p) for p in prompts], max(limits)).tokens
    for result, whole, limit in zip(results, expected, limits):
        assert result.token_ids == whole[:limit]

    # The same rule with the first request caught holding a slot: decoding, and still prefilling its
    # prompt in chunks (8 of its 24 tokens in the cache so far, all 24 counted).
    from specjax.serve.requests import LiveRequest as _Live

    second_request = Request(prompts[1], max_tokens=limits[1])
    for filled in (len(long_prompt) + 1, 8):
        scheduler.table.live = {0: _Live(first, 0.0, admitted=0.0, prefilled=min(filled, len(long_prompt)))}
        scheduler.table.kv.lengths[0] = filled
        assert not scheduler.admission.memory_allows([], second_request, 0), filled
    scheduler.table.live = {}
    assert scheduler.admission.memory_allows([], second_request, 0)  # alone, it is admitted

    # A request parked by a preemption (its row on the host) that does not fit yet stays parked at the
    # head of the queue: it is neither prefilled from scratch nor overtaken, though its prompt alone
    # would fit.
    from specjax.serve.requests import RequestHandle

    scheduler.table.live = {0: _Live(first, 0.0, admitted=0.0, prefilled=len(long_prompt))}
    scheduler.table.kv.lengths[0] = len(long_prompt)
    parked = RequestHandle(99, Request(prompts[1][:2], max_tokens=limits[1]), scheduler)
    row = jax.device_get(scheduler.programs.program("take_row")(scheduler.table.state, 1))
    parked._parked = (row.replace(num_generated=np.int32(20), lengths=np.int32(22)), _Live(parked, 0.0, 0.0))
    behind = RequestHandle(100, Request(prompts[1][:2], max_tokens=limits[1]), scheduler)
    scheduler.table.waiting.extend([(parked, 0.0), (behind, 0.0)])
    assert scheduler.admission.memory_allows([], parked.request, 0) and not scheduler.admission.memory_allows([], parked.request, 20)
    scheduler.admission.admit()
    assert list(scheduler.table.live) == [0] and parked._parked is not None
    assert [h for h, _ in scheduler.table.waiting] == [parked, behind]


def test_memory_relief_drops_drafter_states_before_it_preempts():
    """Drafter states go first (newest, and non-speculating rows, first); preemption covers only what
    the staying rows' drafter states cannot; one request always stays."""
    from specjax.serve.controller import HeldRow, relieve_memory

    rows = [HeldRow(0, 0.0, 100, True), HeldRow(1, 1.0, 50, True), HeldRow(2, 2.0, 10, True)]
    per = {"target": 10, "drafter": 1}
    plan = lambda excess, rows=rows, per=per: relieve_memory(rows, per, excess)  # noqa: E731
    assert (plan(5).drop_drafter, plan(5).preempt) == ((2,), ())
    assert (plan(15).drop_drafter, plan(15).preempt, plan(15).freed_bytes) == ((2, 1), (), 60)
    assert (plan(200).drop_drafter, plan(200).preempt, plan(200).freed_bytes) == ((1, 0), (2,), 260)
    assert (plan(10_000).drop_drafter, plan(10_000).preempt) == ((0,), (2, 1))
    quiet = [HeldRow(0, 0.0, 100, True, speculating=False)] + rows[1:]
    assert plan(5, quiet).drop_drafter == (0,)
    assert (plan(5, per={"target": 10}).drop_drafter, plan(5, per={"target": 10}).preempt) == ((), (2,))
    assert plan(10_000, [rows[0]]).preempt == ()


def test_memory_relief_windows_drafters_before_it_drops_or_preempts():
    """With a drafter window, speculating rows whose drafter context is longer than the window are
    windowed first, longest first, and keep speculating; drops and preemption cover only the rest,
    counting a windowed row's drafter bytes as its window's."""
    from specjax.serve.controller import HeldRow, relieve_memory

    rows = [HeldRow(0, 0.0, 100, True), HeldRow(1, 1.0, 50, True), HeldRow(2, 2.0, 10, True),
            HeldRow(3, 3.0, 80, True, speculating=False)]
    per = {"target": 10, "drafter": 1}
    plan = lambda excess, rows=rows: relieve_memory(rows, per, excess, drafter_window=20)  # noqa: E731
    first = plan(30)
    assert (first.window_drafter, first.drop_drafter, first.preempt, first.freed_bytes) == ((0,), (), (), 80)
    assert (plan(100).window_drafter, plan(100).drop_drafter, plan(100).freed_bytes) == ((0, 1), (), 110)
    # The non-speculating row is not windowed (dropping its state loses nothing), and goes first after.
    assert (plan(150).window_drafter, plan(150).drop_drafter, plan(150).preempt) == ((0, 1), (3,), ())
    assert plan(80, [HeldRow(0, 0.0, 100, True, drafter_window=20)]).window_drafter == ()  # already windowed
    big = plan(1_500)  # a preempted row is not windowed as well
    assert (big.preempt, big.window_drafter, big.drop_drafter, big.freed_bytes) == ((3, 2, 1), (0,), (), 1620)
    assert relieve_memory(rows, per, 30).window_drafter == ()  # no window: drop instead, as before
    assert relieve_memory(rows, {"target": 10}, 30, drafter_window=20).window_drafter == ()


def test_the_request_fields_reach_the_server_over_http(target, drafter):
    import httpx

    from test_serve import _serve_in_thread

    scheduler = _adaptive(target, drafter, slot_count=2, probe_every=0)
    url, stop = _serve_in_thread(scheduler)
    try:
        body = {"prompt": [1, 5, 2], "max_tokens": 6, "temperature": 0.0, "speculation": False}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert reply["metrics"]["draft_limit"] == 0 and reply["metrics"]["speculation"] is False
        bad = httpx.post(f"{url}/v1/completions", json={**body, "method": "tree+refiner"}, timeout=60)
        assert bad.status_code == 400 and "not served here" in bad.json()["error"]["message"]
        bad = httpx.post(f"{url}/v1/completions", json={**body, "speculation": "no"}, timeout=60)
        assert bad.status_code == 400
    finally:
        stop()


def test_the_dashboard_shows_the_controllers_decisions():
    from rich.console import Console

    from specjax.monitor.serving import ServingMetrics
    from specjax.serve.top import parse_metrics, render, summarize

    metrics = ServingMetrics("adaptive")
    metrics.policy("chain", None)
    metrics.policy("ar", "faster")
    metrics.policy("chain:3", "probe")
    metrics.policy("ar", "faster")
    metrics.controller(3.5, {"ar": 40.0, "chain": 31.5}, 2.0)
    metrics.measured_tokens_per_step(3.25)
    metrics.memory_budget(64 * 2**20, 2.5, True)
    metrics.preempted()
    metrics.drafter_state_dropped()
    metrics.drafter_state_dropped()
    metrics.finished("stop", 1.0, {"distinct_2": 0.5, "distinct_3": 0.75})
    view = summarize(parse_metrics(metrics.prometheus_text()), None)
    assert view["policy"] == "ar" and view["switches"] == {"faster": 2, "probe": 1}
    assert view["kv_alarm"] and view["preemptions"] == 1 and view["drafter_drops"] == 2
    assert view["distinct"] == {"2": 0.5, "3": 0.75}
    console = Console(width=160, record=True)
    console.print(render(view, "http://127.0.0.1:1"))
    screen = console.export_text()
    assert "policy ar" in screen and "faster 2, probe 1" in screen and "predicted 3.50, measured 3.25" in screen
    assert "ALARM" in screen and "2.5 s" in screen and "preempted 1" in screen and "2: 0.50" in screen
    assert "drafter states dropped 2" in screen


def test_probes_back_off_while_a_load_holds_and_resume_when_it_changes():
    controller = _controller(probe_every=4)
    _observe_chain(controller, 0.8)
    ar = lambda rows: controller.observe_call("ar", rows, 128, FULL_BATCH["ar"], rows * 10, rows * 10,  # noqa: E731
                                              np.zeros(BLOCK - 1), np.zeros(BLOCK - 1))

    def run(calls, rows):
        reasons = []
        for _ in range(calls):
            decision = controller.decide(rows, 128, [None] * rows)
            reasons.append(decision.reason)
            ar(rows) if decision.policy == "ar" else _observe_chain(controller, 0.8, rows=rows, policy=decision.policy)
        return reasons

    first, later = run(100, 32)[:50], run(200, 32)
    assert controller.current == "ar"
    # Probes of the losing chains thin out: at most one per policy per 64 calls once backed off.
    assert later.count("probe") / len(later) < first.count("probe") / len(first)
    assert later.count("probe") <= 2 * (200 // 64 + 1)
    assert run(10, 1).count("probe") >= 1  # batch one: a new load, probed again at once


def test_remembered_acceptance_spares_a_fresh_server_its_opening_probes():
    """A fresh controller probes each policy it knows nothing of at once; one that starts from the
    last run's acceptance lets every policy wait its interval, so a load where AR wins pays for no
    probe in its first probe_every calls."""
    def opening(priors):
        controller = _controller(probe_every=16)
        if priors:
            assert controller.load_priors({"block": BLOCK, "acceptance": [0.3] * (BLOCK - 1)})
        controller.current = "ar"
        reasons = []
        for _ in range(15):
            decision = controller.decide(32, 128, [None] * 32)
            reasons.append(decision.reason)
            controller.observe_call(decision.policy, 32, 128, FULL_BATCH[decision.policy], 320, 320,
                                    np.zeros(BLOCK - 1), np.zeros(BLOCK - 1))
        return reasons

    assert opening(priors=False).count("probe") == 2  # chain:3 and chain, each once
    assert opening(priors=True).count("probe") == 0


def test_a_probe_replaces_a_stale_cost_so_one_bad_call_cannot_lock_a_policy_out():
    controller = _controller(probe_every=4)
    _observe_chain(controller, 0.05)  # poor acceptance: AR is the better policy at one row
    controller.observe_call("ar", 1, 128, 10 * BATCH_ONE["ar"], 10, 10, np.zeros(BLOCK - 1), np.zeros(BLOCK - 1))
    assert controller.seconds_per_call("ar", 1, 128) == 10 * BATCH_ONE["ar"]  # one cold, slow call
    # Predicted 10x too slow, AR waits the longest probe interval (16 x 4 calls), then one probe
    # measures it afresh and it wins.
    for _ in range(100):
        decision = controller.decide(1, 128, [None])
        if decision.policy == "ar":
            controller.observe_call("ar", 1, 128, BATCH_ONE["ar"], 10, 10, np.zeros(BLOCK - 1), np.zeros(BLOCK - 1))
        else:
            _observe_chain(controller, 0.05, policy=decision.policy)
    assert controller.current == "ar" and controller.seconds_per_call("ar", 1, 128) == pytest.approx(BATCH_ONE["ar"])


@pytest.mark.slow
def test_an_adaptive_server_with_trees_in_its_set_stays_exact(target, drafter, tmp_path):
    """Auto-sized trees among the policies (their costs measured at the slot count), switched in
    and out by probes under running greedy and sampled requests: the greedy outputs are AR's."""
    scheduler = _adaptive(target, drafter, tree=TreeConfig(buckets=(1, 4, 8)), latency_cache=tmp_path,
                          policies=("ar", "chain:1", "tree"), probe_every=2, patience=1, margin=0.0)
    limits = [24, 20, 17, 24]
    try:
        greedy = [scheduler.submit(Request(tuple(p), max_tokens=n, temperature=0.0)) for p, n in zip(PROMPTS, limits)]
        sampled = [scheduler.submit(Request(tuple(p), max_tokens=10, temperature=1.0, seed=i))
                   for i, p in enumerate(PROMPTS[4:])]
        results = [h.result(timeout=600) for h in greedy]
        assert all(h.result(timeout=600).finish_reason in ("length", "stop") for h in sampled)
    finally:
        scheduler.shutdown()
    expected = Engine(target).generate(PROMPTS[:4], max(limits)).tokens
    for result, whole, limit in zip(results, expected, limits):
        assert result.token_ids == whole[:limit]
    used = set().union(*(r.metrics["policy_steps"] for r in results))
    assert "tree" in used and len(used) >= 2, used


def test_a_controller_starts_from_an_earlier_runs_acceptance_on_the_policy_measured_fastest(tmp_path):
    fresh = _controller()
    fresh.choose_start(1, 128)
    # The 0.5 prior: chain:3 commits 1.875 tokens a step for 1.3x AR's cost, the chain 1.99 for 1.4x.
    assert fresh.current == "chain:3"
    poor = _controller()
    _observe_chain(poor, 0.1)
    assert poor.priors()["acceptance"][0] == pytest.approx(0.1)
    later = _controller()
    assert later.load_priors(json.loads(json.dumps(poor.priors())))
    assert later.choose_start(1, 128) == "ar"  # 1.1 tokens a step do not pay for the chain's cost
    assert not later.acceptance_seen.any()  # still a prior: the first observation replaces it
    _observe_chain(later, 0.9)
    assert later.acceptance[0] == pytest.approx(0.9)
    other_block = Controller(("ar", "chain"), 16)
    assert not other_block.load_priors(poor.priors())  # another block's acceptance is ignored, and says so
    assert (other_block.acceptance == 0.5).all()
    # A run that measures less than the last (one policy's start-up, no acceptance) passes the rest on.
    earlier = _controller()
    earlier.startup_s = {("ar", 1): 0.2, ("chain", 1): 0.4}
    partial = _controller()
    assert partial.load_priors(earlier.priors() | {"acceptance": poor.priors()["acceptance"]})
    partial.startup_s = {("chain", 1): 0.5}
    assert partial.priors()["startup_s"] == [["ar", 1, 0.2], ["chain", 1, 0.5]]
    assert partial.priors()["acceptance"] == poor.priors()["acceptance"]
    path = tmp_path / "priors.json"
    poor.save_priors_file(path)
    assert later.load_priors_file(path) and not other_block.load_priors_file(path)
    path.write_text("{not json")
    assert not later.load_priors_file(path)  # a damaged file is a lost prior, not an error


def test_an_adaptive_server_keeps_its_acceptance_for_the_next_start(target, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    first = _adaptive(target, drafter, remember=True, compile_rest="auto")
    try:
        first.submit(Request(tuple(PROMPTS[0]), max_tokens=12, temperature=0.0)).result(timeout=300)
    finally:
        first.shutdown()
    saved = list((tmp_path / "serve").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["acceptance"] == first.controller.priors()["acceptance"]
    second = _adaptive(target, drafter, remember=True)
    second.shutdown()
    assert second.controller.acceptance.tolist() == pytest.approx(
        [0.5 if a is None else a for a in first.controller.priors()["acceptance"]])


def test_the_next_start_begins_on_the_policy_the_cached_costs_favour(target, drafter, tmp_path, monkeypatch):
    """Each policy's start-up cost per live-row bucket is kept with the acceptance; the next start
    chooses its start policy (the one compiled first) from them instead of always the longest
    chain, and takes every policy's cached costs instead of timing it again."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    first = _adaptive(target, drafter, remember=True, compile_rest="auto")
    first.shutdown()  # no request ran: the costs alone are worth keeping
    assert first.policy == "chain" and not first.started_from_cache
    assert first.compile_rest == "before_ready"  # "auto" on a first start: its start policy is a guess
    [saved] = (tmp_path / "serve").glob("*.json")
    kept = json.loads(saved.read_text())
    assert {(p, r) for p, r, _ in kept["startup_s"]} == {(p, r) for p in ("ar", "chain") for r in first.shapes.row_buckets}
    measured = kept["startup_s"]
    for cheap, dear in (("ar", "chain"), ("chain", "ar")):
        # Make one policy 100 times the other's cost: the next start must begin on the cheap one.
        kept["startup_s"] = [[p, r, (100.0 if p == dear else 1.0) * s] for p, r, s in measured]
        saved.write_text(json.dumps(kept))
        later = _adaptive(target, drafter, remember=True, compile_rest="auto")
        later.shutdown()
        assert later.started_from_cache and later.policy == cheap, (cheap, later.policy)
        assert later.compile_rest == "while_idle"  # "auto" where the cached costs chose the start
        assert later.warmup._timed == set()  # nothing timed: every policy's costs came from the cache
        assert json.loads(saved.read_text())["startup_s"] == kept["startup_s"]


def test_the_start_policy_is_the_longest_chain_whatever_else_the_set_holds():
    assert Controller(("ar", "tree", "chain:3"), BLOCK).current == "chain:3"
    assert Controller(("tree+refiner", "ar"), BLOCK).current == "ar"
    assert Controller(("ar", "chain", "chain:7"), 16, ControllerConfig(start="ar")).current == "ar"
    with pytest.raises(SpecjaxError, match="not among"):
        Controller(("ar",), BLOCK, ControllerConfig(start="chain"))


def test_the_run_report_reads_snapshots_and_requests_and_rejects_bad_logs(tmp_path, capsys):
    """Snapshots turn counter totals into interval rates; the report's summary and figure come from
    the log alone; a missing, empty or malformed log is a clear error."""
    import json

    from specjax.cli import main
    from specjax.monitor.serving import ServingMetrics

    import time

    log = tmp_path / "run.jsonl"
    metrics = ServingMetrics("adaptive", log, snapshot_every=0.5)
    start = time.time() - 2.0  # the snapshot close() writes comes at the real time
    metrics.tick(now=start)  # the first tick starts the first interval
    metrics.policy("chain", None)
    metrics.verify_steps(10, 30, [6, 3, 1])  # 10 steps, 30 drafts: tau 1 + 10/10 = 2
    metrics.tokens_streamed(20, None)
    metrics.tick(now=start + 0.2)  # not due yet
    metrics.tick(now=start + 1.0)
    metrics.policy("ar", "faster")
    metrics.tokens_streamed(5, 0.5)
    metrics.tick(now=start + 2.0)
    metrics.finished("length", 1.5, {"id": 0, "finish_reason": "length", "e2e_s": 1.5, "ttft_s": 0.5,
                                     "completion_tokens": 11, "preemptions": 0})
    metrics.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    snaps = [r for r in lines if r["kind"] == "snapshot"]
    assert [s["policy"] for s in snaps[:2]] == ["chain", "ar"]
    assert snaps[0]["tau"] == 2.0 and snaps[0]["per_position_acceptance"] == [0.6, 0.3, 0.1]
    assert snaps[0]["tokens_per_s"] == 20.0 and snaps[1]["tokens_per_s"] == 5.0 and snaps[1]["tau"] is None
    assert snaps[1]["switches"] == 1

    assert main(["report", str(log), "--out", str(tmp_path / "r.png"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["requests"] == 1 and summary["tpot_p50_s"] == pytest.approx(0.1)
    assert summary["policy_time_share"]["chain"] == pytest.approx(0.5, abs=0.05)
    assert (tmp_path / "r.png").stat().st_size > 10_000

    assert main(["report", str(tmp_path / "missing.jsonl")]) != 0
    assert "--metrics-log" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"time": 1}\nnot json\n')
    assert main(["report", str(tmp_path / "bad.jsonl")]) != 0
    assert "bad.jsonl:2" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("\n")
    assert main(["report", str(tmp_path / "empty.jsonl")]) != 0


def test_compiling_the_rest_while_idle_waits_out_every_request(target, drafter, monkeypatch):
    """compile_rest="while_idle": the server serves on its start policy at once, and each of the
    other policies' programs is compiled only while no request runs or waits; once idle, every
    policy is compiled and timed. The first background compile is held until a burst is submitted,
    so its gate meets a busy server."""
    import threading

    from specjax.serve.programs import Programs

    burst_submitted, holder, compiles = threading.Event(), {}, []
    original = Programs.compile_steps

    def recording(self, policy, progress=None, before_each=None):
        def gate():
            if before_each is not None:  # a background compile: the scheduler exists by now
                burst_submitted.wait(timeout=600)
                before_each()
                compiles.append((policy, holder["s"].num_running, holder["s"].num_waiting))
        return original(self, policy, progress, gate)

    monkeypatch.setattr(Programs, "compile_steps", recording)
    config = ServeConfig(method="adaptive", slots=2, context_length=64, max_new_tokens=24, steps_per_sync=2,
                         prompt_bucket=16, controller=ControllerConfig(policies=("ar", "chain"), remember=False),
                         compile_rest="while_idle")
    scheduler = holder["s"] = Scheduler(target, drafter, config, latency_cache=None)
    try:
        start = scheduler.controller.current
        assert scheduler.controller.ready == {start}  # serving before the rest is compiled
        handles = [scheduler.submit(Request((3, 1, 4, 1, 5, i), max_tokens=24)) for i in range(6)]
        burst_submitted.set()
        outputs = [h.result(timeout=600).token_ids for h in handles]
        assert scheduler.wait_compiled(timeout=600)
        assert scheduler.controller.ready == {"ar", "chain"}
        assert compiles and all(running == waiting == 0 for _, running, waiting in compiles), compiles
        assert scheduler.warmup.idle_waits >= 1  # the first gate met the burst and waited it out
        assert all(len(o) == 24 or o[-1] in target.eos_token_ids for o in outputs)
    finally:
        scheduler.shutdown(drain=False)


def test_shutting_down_stops_the_background_compiler_between_programs(target, drafter, monkeypatch):
    """A server shut down while its other policies compile returns only once the background compiler
    has left, and that compiler starts no program after the shut-down: a process that exits with a
    thread inside XLA aborts."""
    import threading

    from specjax.serve.programs import Programs

    started, release, compiled = threading.Event(), threading.Event(), []
    original = Programs.compile_steps

    def held(self, policy, progress=None, before_each=None):
        def gate():
            if before_each is not None:  # the background compiler, held at its first program
                started.set()
                release.wait(timeout=600)
                before_each()
                compiled.append(policy)
        return original(self, policy, progress, gate)

    monkeypatch.setattr(Programs, "compile_steps", held)
    # The configuration of the while-idle test above: its start policy's programs are compiled already.
    config = ServeConfig(method="adaptive", slots=2, context_length=64, max_new_tokens=24, steps_per_sync=2,
                         prompt_bucket=16, controller=ControllerConfig(policies=("ar", "chain"), remember=False),
                         compile_rest="while_idle")
    scheduler = Scheduler(target, drafter, config, latency_cache=None)
    assert started.wait(timeout=600)
    threading.Timer(0.5, release.set).start()  # released only once shut-down has begun
    scheduler.shutdown(drain=False)
    assert not scheduler.warmup._compiler.is_alive()
    assert compiled == [] and len(scheduler.controller.ready) == 1


def test_compile_rest_is_checked():
    with pytest.raises(SpecjaxError, match="compile_rest"):
        ServeConfig(compile_rest="later")
