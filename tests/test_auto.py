"""The auto method: AR, chain or tree at each step by expected tokens per second. Forced cost models
show it choosing AR where verification is dear and speculating where it is cheap; its output is AR's
either way, and its choice rule is checked on hand-made estimates."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from specjax.decode.auto import AUTO_POLICIES, AutoConfig, AutoState, choose_policy, observe
from specjax.decode.budget import LatencyModel
from specjax.decode.engine import Engine
from specjax.decode.tree import TreeConfig
from specjax.errors import SpecjaxError

from conftest import SPEC_BLOCK
from test_speculative import PROMPTS

TREE = TreeConfig(buckets=(1, 2, 4, 8))


def _forced(monkeypatch, verify_s, fixed_s):
    """Every Engine's latency model replaced by this one (seconds at 1, 2, 4 and 8 nodes)."""
    model = LatencyModel(sizes=[1, 2, 4, 8], verify_s=list(verify_s), fixed_s=fixed_s)
    monkeypatch.setattr(Engine, "_latency_model", lambda self, *args: model)


@pytest.mark.parametrize("case", ["dear_verify", "cheap_verify"])
def test_auto_decodes_ar_where_verifying_is_dear_and_speculates_where_it_is_cheap(target, drafter, monkeypatch,
                                                                                   case):
    if case == "dear_verify":  # a 4-token verify costs 10 decode steps: no drafter pays for that
        _forced(monkeypatch, [1.0, 6.0, 10.0, 20.0], fixed_s=1.0)
    else:  # verifying is as cheap as a step and drafting nearly free
        _forced(monkeypatch, [1.0, 1.0, 1.0, 1.0], fixed_s=0.01)
    engine = Engine(target, drafter)
    ar = engine.generate(PROMPTS, 40, ignore_eos=True)
    auto = engine.generate(PROMPTS, 40, ignore_eos=True, method="auto", tree=TREE, auto=AutoConfig(probe_every=16))
    assert auto.tokens == ar.tokens
    steps = auto.stats["auto"]["policy_steps"]
    total = sum(steps.values())
    if case == "dear_verify":
        assert steps["ar"] >= 0.8 * total, steps  # after one step of each speculative policy, and probes
        assert 2 <= steps["chain"] + steps["tree"] <= 2 + total // 16 + 1, steps
        # A second greedy call starts from what the first measured: no exploring again.
        again = engine.generate(PROMPTS, 40, ignore_eos=True, method="auto", tree=TREE, auto=AutoConfig(probe_every=16))
        assert again.tokens == ar.tokens
        second = again.stats["auto"]["policy_steps"]
        assert sum(second.values()) <= 39  # this call's steps only: 40 tokens, the first from the prefill
        assert second["chain"] + second["tree"] <= steps["chain"] + steps["tree"] - 2, (steps, second)
    else:
        assert steps["ar"] == 0 and steps["chain"] + steps["tree"] == total, steps
        assert auto.stats["tau"] > 1.5
    assert auto.stats["auto"]["chain_step_over_decode_step"] == pytest.approx(
        1.0 + 0.01 if case == "cheap_verify" else 1.0 + 10.0)


def test_auto_runs_the_plain_ar_program_while_speculation_loses_and_no_probe_is_due(target, drafter, monkeypatch):
    """Auto's own AR branch keeps the drafter's context current; a call in which the measurements keep
    it on AR throughout runs the plain AR program instead, and its steps bring the next probe nearer."""
    _forced(monkeypatch, [1.0, 6.0, 10.0, 20.0], fixed_s=1.0)
    engine = Engine(target, drafter)
    ar = engine.generate(PROMPTS, 40, ignore_eos=True)
    config = AutoConfig(probe_every=100)
    run = lambda: engine.generate(PROMPTS, 40, ignore_eos=True, method="auto", tree=TREE, auto=config)  # noqa: E731
    first, second, third = run(), run(), run()
    for call in (first, second, third):
        assert call.tokens == ar.tokens
    # The first explores chain and tree and settles on AR; 37 AR steps + 39 more stay under 100.
    assert not first.stats["auto"]["plain_ar"] and first.stats["auto"]["policy_steps"]["chain"] >= 1
    assert second.stats["auto"]["plain_ar"]
    assert second.stats["auto"]["policy_steps"] == {"ar": 39, "chain": 0, "tree": 0}
    assert second.stats["memory"] == ar.stats["memory"]  # the AR program's: no drafter state at all
    assert second.stats["tau"] == 1.0
    # The third call's steps would pass 100 since the last speculative step: it probes again.
    assert not third.stats["auto"]["plain_ar"]
    assert third.stats["auto"]["policy_steps"]["chain"] + third.stats["auto"]["policy_steps"]["tree"] >= 1


def test_the_choice_rule_explores_holds_with_a_margin_and_probes():
    config = AutoConfig(margin=0.1, probe_every=4)
    seconds = jnp.asarray([1.0, 2.0, 2.5])
    auto = AutoState.fresh()
    assert AUTO_POLICIES[int(choose_policy(auto, seconds, config))] == "chain"  # nothing measured yet
    auto = observe(auto, 1, jnp.float32(2.1), jnp.float32(0), config)
    assert AUTO_POLICIES[int(choose_policy(auto, seconds, config))] == "tree"  # then the tree once
    auto = observe(auto, 2, jnp.float32(2.4), jnp.float32(2.5), config)
    # chain 2.1 / 2 = 1.05 tokens/s, tree 2.4 / 2.5 = 0.96, AR 1: the chain is best, and the tree ran
    # last; moving to the chain speculates less, so it needs no margin.
    assert AUTO_POLICIES[int(choose_policy(auto, seconds, config))] == "chain"
    on_ar = auto.replace(current=jnp.int32(0))
    assert int(choose_policy(on_ar, seconds, config)) == 0  # 1.05 < 1.1: not enough to leave AR
    probing = on_ar.replace(idle=jnp.int32(4))
    assert AUTO_POLICIES[int(choose_policy(probing, seconds, config))] == "chain"  # probe the best speculative
    faster = observe(auto, 1, jnp.float32(4.0), jnp.float32(0), AutoConfig(ema=1.0))
    assert float(faster.tokens_per_step[1]) == 4.0 and int(faster.idle) == 0
    unchanged = observe(faster, 1, jnp.float32(jnp.nan), jnp.float32(0), config)  # no live row: nothing learnt
    assert float(unchanged.tokens_per_step[1]) == 4.0
    with pytest.raises(SpecjaxError, match="margin"):
        AutoConfig(margin=1.0)


def test_probes_that_keep_losing_back_off_and_a_winning_probe_resets_them():
    config = AutoConfig(probe_every=4, max_probe_factor=4)
    seconds = jnp.asarray([1.0, 3.0, 3.5])
    auto = AutoState.fresh()
    auto = observe(auto, 1, jnp.float32(1.5), jnp.float32(0), config, seconds)  # exploration: no probe yet
    auto = observe(auto, 2, jnp.float32(1.6), jnp.float32(3.5), config, seconds)
    auto = observe(auto, 0, jnp.float32(1.0), jnp.float32(0), config, seconds)
    assert int(auto.probe_factor) == 1
    for factor in (2, 4, 4):  # each losing probe doubles the interval, up to the cap
        waited = auto.replace(idle=jnp.int32(4 * int(auto.probe_factor)))
        assert int(choose_policy(waited.replace(idle=waited.idle - 1), seconds, config)) == 0  # not yet
        probe = int(choose_policy(waited, seconds, config))
        assert probe > 0
        auto = observe(waited, probe, jnp.float32(1.5), jnp.float32(3.5), config, seconds)
        assert int(auto.probe_factor) == factor
        auto = observe(auto, 0, jnp.float32(1.0), jnp.float32(0), config, seconds)  # back on AR
    waited = auto.replace(idle=jnp.int32(16))
    won = observe(waited, 1, jnp.float32(5.0), jnp.float32(0), AutoConfig(ema=1.0, probe_every=4), seconds)
    assert int(won.probe_factor) == 1  # 5 tokens for 3x a step: speculation pays again


def test_auto_refuses_a_fixed_tree_budget(target, drafter):
    with pytest.raises(SpecjaxError, match="budget rule"):
        Engine(target, drafter).generate(PROMPTS, 4, method="auto", tree=TreeConfig(budget=SPEC_BLOCK))


@pytest.mark.slow  # a minute: 20,000 sampled rows through every policy of auto
@pytest.mark.parametrize("broken", [False, True])
def test_sampled_auto_matches_the_exact_target_distribution(target, drafter, monkeypatch, broken):
    """Sampling through auto, which here switches between AR, chain and tree within each row's output
    (cheap verify; probes every step), matches the enumerated distribution; a broken residual rule in
    the chain and tree acceptance fails the same test."""
    import numpy as np

    from specjax.decode import slots
    from specjax.decode.sampling import SamplingConfig

    from stats import chi_square_pvalue
    from test_speculative import _broken_impl, _exact_marginals
    from test_decode import TINY

    _forced(monkeypatch, [1.0, 1.2, 1.4, 2.0], fixed_s=0.3)
    if broken:  # its own config below, so the step is traced anew with the broken rule
        monkeypatch.setattr(slots, "accept_sampled", _broken_impl)
    prompt, depth, sampling = [1, 5, 2], 3, SamplingConfig(temperature=1.0)
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth)
    result = Engine(target, drafter).generate([prompt] * 20_000, depth, sampling, seed=11, ignore_eos=True,
                                              method="auto", tree=TREE,
                                              auto=AutoConfig(probe_every=1, margin=0.01 if broken else 0.0))
    out = np.asarray(result.tokens)
    pvalues = [chi_square_pvalue(np.bincount(out[:, i], minlength=TINY.vocab_size), exact[i]) for i in range(depth)]
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues
