"""Draft trees: construction, the budget rule, the latency model, and exact tree verification
(token for token when greedy, in distribution when sampling; a broken rule must fail)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import tree as tree_module
from specjax.decode.budget import LatencyModel, TreeCosts, chosen_bucket, monotone_costs
from specjax.decode.engine import Engine
from specjax.decode.sampling import SamplingConfig
from specjax.decode.tree import (DraftTree, TreeConfig, accept_tree, accept_tree_draws, ancestor_mask, best_first_tree,
                                 fixed_tree)
from specjax.errors import SpecjaxError

from stats import chi_square_pvalue
from test_decode import TINY
from test_speculative import PROMPTS, SAMPLINGS, _exact_marginals


def _candidates(seed, batch=2, depths=3, k=3):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(6), size=(batch, depths))  # [B, K, 6]
    order = np.argsort(-probs, axis=-1)[..., :k]
    log_probs = np.log(np.take_along_axis(probs, order, axis=-1))
    tokens = order + 100  # distinct from node indices, to catch mix-ups
    return jnp.asarray(log_probs, jnp.float32), jnp.asarray(tokens, jnp.int32)


def _all_paths(log_probs, tokens):
    """Every path (tuple of ranks) with its log-probability, by brute force, for one row."""
    depths, k = log_probs.shape
    paths = {}
    for d in range(1, depths + 1):
        for ranks in itertools.product(range(k), repeat=d):
            paths[ranks] = sum(float(log_probs[i, r]) for i, r in enumerate(ranks))
    return paths


def test_best_first_tree_holds_the_most_probable_paths_in_order():
    log_probs, tokens = _candidates(0)
    num_nodes = 12
    tree = best_first_tree(jnp.asarray([7, 8]), log_probs, tokens, num_nodes)
    for row in range(2):
        lp = np.asarray(tree.log_prob[row])
        parent = np.asarray(tree.parent[row])
        assert tree.token[row, 0] == [7, 8][row] and parent[0] == -1 and lp[0] == 0
        assert np.all(np.diff(lp) <= 1e-6), "pop order is non-increasing in path probability"
        assert np.all(parent[1:] < np.arange(1, num_nodes)), "parents come before children"
        depth = np.asarray(tree.depth[row])
        assert np.all(depth[1:] == depth[parent[1:]] + 1)
        # The nodes are exactly the num_nodes - 1 most probable paths.
        best = sorted(_all_paths(np.asarray(log_probs[row]), tokens[row]).values(), reverse=True)[: num_nodes - 1]
        np.testing.assert_allclose(np.sort(lp[1:])[::-1], best, rtol=1e-5)
        # Each node's token is the candidate its path log-probability came from.
        for v in range(1, num_nodes):
            rank = int(np.flatnonzero(np.asarray(tokens[row, depth[v] - 1]) == int(tree.token[row, v]))[0])
            np.testing.assert_allclose(lp[v] - lp[parent[v]], float(log_probs[row, depth[v] - 1, rank]), rtol=1e-5)


def test_best_first_tree_marks_nodes_past_the_candidates_invalid():
    log_probs, tokens = _candidates(1, batch=1, depths=2, k=2)
    tree = best_first_tree(jnp.asarray([0]), log_probs, tokens, 10)  # only 2 + 4 paths exist
    assert np.asarray(tree.valid[0]).tolist() == [True] * 7 + [False] * 3


def test_fixed_tree_is_the_chain_with_siblings():
    log_probs, tokens = _candidates(2, batch=1, depths=3, k=2)
    tree = fixed_tree(jnp.asarray([5]), log_probs, tokens, width=2)
    assert np.asarray(tree.parent[0]).tolist() == [-1, 0, 0, 1, 1, 3, 3]
    assert np.asarray(tree.depth[0]).tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert np.asarray(tree.token[0, 1::2]).tolist() == np.asarray(tokens[0, :, 0]).tolist()
    np.testing.assert_allclose(tree.log_prob[0, 5], log_probs[0, :, 0].sum(), rtol=1e-5)


def test_ancestor_mask_matches_the_parent_pointers():
    parent = jnp.asarray([[-1, 0, 0, 1, 2, 3, 1]])
    tree = DraftTree(token=jnp.zeros((1, 7), jnp.int32), parent=parent, depth=jnp.zeros((1, 7), jnp.int32),
                     log_prob=jnp.zeros((1, 7)), valid=jnp.asarray([[True] * 6 + [False]]))
    mask = np.asarray(ancestor_mask(tree)[0])
    expected = np.zeros((7, 7), bool)
    for v in range(6):
        u = v
        while u >= 0:
            expected[v, u] = True
            u = int(parent[0, u])
    expected[6, 6] = True  # an invalid node sees only itself
    assert (mask == expected).all()


def test_accept_tree_descends_while_the_target_agrees():
    #      0(root)
    #     /      \
    #   1:t4     2:t5
    #    |
    #   3:t6
    tree = DraftTree(token=jnp.asarray([[9, 4, 5, 6]]), parent=jnp.asarray([[-1, 0, 0, 1]]),
                     depth=jnp.asarray([[0, 1, 1, 2]]), log_prob=jnp.zeros((1, 4)), valid=jnp.ones((1, 4), bool))
    vocab = 10
    def logits_with_argmax(tokens):
        return jnp.asarray(np.eye(vocab)[tokens] * 5.0, jnp.float32)[None]  # [1, N, V]
    n, nxt, path = accept_tree(tree, logits_with_argmax([5, 0, 7, 0]), SamplingConfig(), jax.random.key(0), 3)
    assert n.tolist() == [1] and nxt.tolist() == [7] and path[0, :2].tolist() == [0, 2]
    n, nxt, path = accept_tree(tree, logits_with_argmax([4, 6, 0, 3]), SamplingConfig(), jax.random.key(0), 3)
    assert n.tolist() == [2] and nxt.tolist() == [3] and path[0].tolist() == [0, 1, 3, 3]
    n, nxt, _ = accept_tree(tree, logits_with_argmax([8, 6, 0, 3]), SamplingConfig(), jax.random.key(0), 3)
    assert n.tolist() == [0] and nxt.tolist() == [8]


def _costs(verify, fixed=0.01):
    sizes = [1, 4, 8, 16, 32]
    return TreeCosts(jnp.asarray(sizes, jnp.float32), jnp.asarray([verify(s) for s in sizes], jnp.float32),
                     jnp.float32(fixed))


def test_size_rule_grows_trees_when_verification_is_cheap_and_shrinks_them_when_not():
    log_probs, tokens = _candidates(3, batch=2, depths=4, k=4)
    tree = best_first_tree(jnp.asarray([0, 0]), log_probs, tokens, 32)
    buckets = (1, 4, 8, 16, 32)
    choose = lambda costs, live=jnp.asarray([True, True]): int(chosen_bucket(tree.log_prob, tree.valid, live,
                                                                             costs, buckets)[1])
    flat = choose(_costs(lambda s: 0.01))  # GPU-like: size is free
    steep = choose(_costs(lambda s: 0.01 * s))  # CPU-like
    steeper = choose(_costs(lambda s: 0.04 * s))  # the same CPU at a bigger batch
    assert flat == 32
    assert 1 <= steeper <= steep < 32
    # The rule itself, checked by hand for row 0 alone: the bucket with the most S(b) / T(b).
    costs = _costs(lambda s: 0.01 * s)
    p = np.exp(np.asarray(tree.log_prob[0]))
    rate = lambda b: p[:b].sum() / (0.01 + float(costs.verify_cost(jnp.asarray(b))))  # noqa: E731
    index, size = chosen_bucket(tree.log_prob, tree.valid, jnp.asarray([True, False]), costs, buckets)
    assert int(size) == buckets[int(index)] == max(buckets, key=rate)
    # A step-shaped curve, as bf16 rows padded to 16 give: 1 node cheap, 2 to 16 alike. The greedy
    # stop rule quits at node 2 whenever P(v2) * T(1) < S(1) * (C(2) - C(1)); the bucket rule sees
    # that nodes 3..16 come free with it.
    step = TreeCosts(jnp.asarray([1, 2, 16], jnp.float32), jnp.asarray([0.040, 0.047, 0.047], jnp.float32),
                     jnp.float32(0.004))
    weak = jnp.log(jnp.asarray([[1.0, 0.1, 0.09, 0.08] + [0.05] * 12]))
    assert int(chosen_bucket(weak, jnp.ones_like(weak, bool), jnp.asarray([True]), step, (1, 2, 16))[1]) == 16
    assert 0.1 * (0.004 + 0.040) < 1.0 * (0.047 - 0.040)  # where the greedy rule would have stopped at 1
    # Rows are summed: two identical rows choose what one row chooses; dead rows count nothing.
    twin = best_first_tree(jnp.asarray([0, 0]), log_probs[:1].repeat(2, 0), tokens[:1].repeat(2, 0), 32)
    assert int(chosen_bucket(twin.log_prob, twin.valid, jnp.asarray([True, True]), costs, buckets)[1]) == int(size)
    assert int(chosen_bucket(tree.log_prob, tree.valid, jnp.asarray([False, False]), costs, buckets)[1]) == 1


def test_latency_model_refits_online_and_round_trips(tmp_path):
    model = LatencyModel(sizes=[1, 8, 16], verify_s=[0.01, 0.02, 0.03], fixed_s=0.01)
    # The machine turns out twice as slow to verify 16 nodes as measured: calls using size 16 say so.
    # Each call also pays 0.3 s outside the loop (prefill), which must not leak into the step costs.
    for steps, share in [(40, 0.9), (50, 0.6), (60, 0.3), (70, 0.1), (4, 0.5), (60, 0.8), (8, 0.2)]:
        counts = {8: int(steps * share), 16: steps - int(steps * share)}
        model.observe(steps, counts, 0.3 + steps * 0.01 + counts[8] * 0.02 + counts[16] * 0.06)
    assert 0.05 < model.verify_s[2] < 0.065
    assert abs(model.verify_s[1] - 0.02) < 0.005 and abs(model.fixed_s - 0.01) < 0.004
    assert 0.2 < model.per_call_s < 0.35
    assert model.predicted_wall_s(50, {8: 25, 16: 25}) == pytest.approx(0.3 + 0.5 + 0.5 + 1.5, rel=0.1)
    assert model.verify_s[0] == 0.01  # the plain decode step is never observed and stays as measured
    key = "machine|model|b1|s64"
    model.save(key, tmp_path)
    again = LatencyModel.load(key, tmp_path)
    assert again.verify_s == model.verify_s and again.observations == model.observations
    assert LatencyModel.load("another key", tmp_path) is None


def test_latency_refit_spreads_loop_costs_over_every_size_it_ran():
    """Every size costs 0.05 s to verify, measured alone, but each step in the loop pays 0.025 s
    that the isolated passes miss. Calls run mostly 1-node trees, some 4-node ones. The refit must
    keep the curve flat: charging that cost to 2 and 4 nodes only (size 1 pinned at its isolated
    time) would make drafting look dear and stop the rule from drafting at all."""
    model = LatencyModel(sizes=[1, 2, 4], verify_s=[0.05, 0.05, 0.05], fixed_s=0.005)
    for steps, share in [(100, 0.9), (80, 0.7), (120, 0.95), (90, 0.5), (110, 0.8), (70, 0.6)]:
        counts = {1: int(steps * share), 2: 0, 4: steps - int(steps * share)}
        model.observe(steps, counts, 0.2 + steps * (0.005 + 0.05 + 0.025))
    one, _, four = model.verify_s
    assert one > 0.055 and abs(four - one) < 0.005, model.verify_s  # 1 node took its share of the loop's cost
    # A dip is noise: a larger tree never costs less.
    assert monotone_costs([0.05, 0.08, 0.06, 0.09]) == pytest.approx([0.05, 0.07, 0.07, 0.09])
    dipped = LatencyModel(sizes=[1, 8, 16], verify_s=[0.01, 0.03, 0.02], fixed_s=0.01)
    dipped.observe(10, {8: 5, 16: 5}, 10 * 0.01 + 5 * 0.03 + 5 * 0.02)
    assert dipped.verify_s == sorted(dipped.verify_s), dipped.verify_s


def test_tree_config_refuses_bad_values():
    with pytest.raises(SpecjaxError, match="shape"):
        TreeConfig(shape="star")
    with pytest.raises(SpecjaxError, match="buckets"):
        TreeConfig(buckets=(8, 4))
    with pytest.raises(SpecjaxError, match="budget"):
        TreeConfig(budget=0)
    assert TreeConfig(shape="fixed", width=3).node_buckets(15) == (46,)
    assert TreeConfig(budget=8).node_buckets(15) == (8,)


def test_default_tree_buckets_follow_the_backend(monkeypatch):
    """CPU verification is compute-bound from 1 node; accelerators stay cheap far longer."""
    import specjax.decode.tree as tree_module

    for backend, expected in (("cpu", (1, 2, 4, 8, 16, 32, 64)), ("gpu", (16, 32, 64, 128, 256)),
                              ("tpu", (16, 32, 64, 128, 256))):
        monkeypatch.setattr(tree_module.jax, "default_backend", lambda: backend)
        assert TreeConfig().node_buckets(15) == expected, backend


TREES = [TreeConfig(buckets=(2, 4, 8)), TreeConfig(budget=6), TreeConfig(shape="fixed", width=2)]


@pytest.mark.parametrize("tree", [TREES[0]] + [pytest.param(t, marks=pytest.mark.slow) for t in TREES[1:]],
                         ids=["auto", "budget6", "fixed"])
def test_greedy_tree_equals_autoregressive(target, drafter, tree):
    engine = Engine(target, drafter, latency_cache=False)
    ar = engine.generate(PROMPTS, 30, ignore_eos=True)
    result = engine.generate(PROMPTS, 30, ignore_eos=True, method="tree", tree=tree)
    assert result.tokens == ar.tokens
    stats = result.stats
    assert stats["tau"] > 1.5
    assert sum(stats["tree_bucket_counts"].values()) == stats["verify_steps"]
    assert 1 <= stats["tree_nodes_chosen"] <= max(tree.node_buckets(3))


@pytest.mark.slow
def test_a_tree_holding_the_chain_accepts_at_least_as_much(target, drafter):
    """The fixed-shape tree contains the drafter's greedy chain, so greedy acceptance can only grow
    (best-first trees need not contain it: they trade depth for width by path probability)."""
    engine = Engine(target, drafter, latency_cache=False)
    chain = engine.generate(PROMPTS, 30, ignore_eos=True, method="chain").stats
    tree = engine.generate(PROMPTS, 30, ignore_eos=True, method="tree", tree=TreeConfig(shape="fixed", width=3)).stats
    assert tree["tau"] >= chain["tau"]
    assert tree["per_position_acceptance"][0] >= chain["per_position_acceptance"][0]


def test_greedy_tree_stops_at_eos_like_autoregressive(target, drafter):
    from specjax.io.registry import LoadedModel

    free = Engine(target).generate([PROMPTS[0]], 30, ignore_eos=True).tokens[0]
    engine = Engine(LoadedModel("tiny", TINY, target.params, None, (free[7],)), drafter, latency_cache=False)
    assert engine.generate(PROMPTS, 30, method="tree", tree=TreeConfig(budget=6)).tokens == \
        engine.generate(PROMPTS, 30).tokens


def _sampled_tree_tokens(target, drafter, sampling, count, new_tokens, tree=TreeConfig(budget=6)):
    engine = Engine(target, drafter, latency_cache=False)
    result = engine.generate([[1, 5, 2]] * count, new_tokens, sampling, seed=5, ignore_eos=True, method="tree",
                             tree=tree)
    return np.asarray(result.tokens), result.stats


# The second sampling config (top-k/top-p filters) runs with -m slow; the first keeps the default suite exact.
@pytest.mark.parametrize("sampling", [SAMPLINGS[0], pytest.param(SAMPLINGS[1], marks=pytest.mark.slow)])
def test_sampled_tree_matches_the_exact_target_distribution(target, drafter, sampling):
    exact = _exact_marginals(target.params, np.asarray([1, 5, 2]), sampling, depth=3)
    out, stats = _sampled_tree_tokens(target, drafter, sampling, 20_000, 3)
    assert 0.1 < stats["per_position_acceptance"][0] < 0.99  # both descending and stopping exercised
    for position in range(3):
        counts = np.bincount(out[:, position], minlength=TINY.vocab_size)
        assert chi_square_pvalue(counts, exact[position]) > 1e-3, f"token {position + 1}"


def _broken_accept_tree_draws(tree, drawn, max_depth):
    """The root's first child is taken as if the target had drawn it: a draft accepted unverified."""
    return accept_tree_draws(tree, drawn.at[:, 0].set(tree.token[:, 1]), max_depth)


def test_a_broken_tree_rule_fails_the_same_test(target, drafter, broken_rule):
    """The tree acceptance rule broken inside the slot step that every tree runs on."""
    sampling = SAMPLINGS[0]
    exact = _exact_marginals(target.params, np.asarray([1, 5, 2]), sampling, depth=2)
    broken_rule(tree_module, "accept_tree_draws", _broken_accept_tree_draws)
    # 4,000 rows: the broken rule's p-value is below 1e-300 at seeds 5-7 (1e-6 is the line).
    out = Engine(target, drafter, latency_cache=False).generate([[1, 5, 2]] * 4_000, 2, sampling, seed=5,
                                                                ignore_eos=True, method="tree",
                                                                tree=TreeConfig(budget=6))
    counts = np.bincount(np.asarray(out.tokens)[:, 1], minlength=TINY.vocab_size)  # the prefill draws token 0
    assert chi_square_pvalue(counts, exact[1]) < 1e-6


def test_tree_methods_check_their_inputs(target, drafter):
    engine = Engine(target, drafter, latency_cache=False)
    with pytest.raises(SpecjaxError, match="refiner"):
        engine.generate(PROMPTS, 8, method="tree+refiner")
    with pytest.raises(SpecjaxError, match="drafter"):
        Engine(target).generate(PROMPTS, 8, method="tree")


@pytest.mark.slow  # the greedy tree with Pallas attention stays in the default suite
def test_pallas_attention_in_the_model_matches_xla(target):
    """The model with attention="pallas" (the tree kernel, interpreted on CPU) computes the same
    logits as the XLA path: prefill (causal), a decode step, and a tree block over a ragged cache."""
    import dataclasses

    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    pallas_config = dataclasses.replace(TINY, attention="pallas")
    tokens = jnp.asarray([[1, 5, 2, 7, 4, 4], [3, 9, 0, 0, 0, 0]])
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    lengths = jnp.asarray([6, 2])
    outs = {}
    for name, config in (("xla", TINY), ("pallas", pallas_config)):
        prefill = forward(target.params, config, tokens, positions, KVCache.zeros(config, 2, 32), jnp.zeros(2, jnp.int32))
        step = forward(target.params, config, jnp.asarray([[6], [1]]), lengths[:, None], prefill.cache, lengths)
        tree = DraftTree(token=jnp.asarray([[6, 2, 3, 8], [1, 1, 5, 2]]), parent=jnp.asarray([[-1, 0, 0, 1]] * 2),
                         depth=jnp.asarray([[0, 1, 1, 2]] * 2), log_prob=jnp.zeros((2, 4)), valid=jnp.ones((2, 4), bool))
        verify = forward(target.params, config, tree.token, lengths[:, None] + tree.depth, prefill.cache, lengths,
                         block_mask=ancestor_mask(tree))
        outs[name] = (prefill.logits, step.logits, verify.logits)
    for xla, pallas in zip(outs["xla"], outs["pallas"]):
        np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), atol=2e-4, rtol=2e-4)


def test_greedy_tree_with_pallas_attention_equals_autoregressive(target, drafter):
    import dataclasses

    from specjax.io.registry import LoadedModel

    pallas_target = LoadedModel("tiny", dataclasses.replace(TINY, attention="pallas"), target.params, None, (3,))
    ar = Engine(target).generate(PROMPTS[:2], 12, ignore_eos=True).tokens
    tree = Engine(pallas_target, drafter, latency_cache=False).generate(
        PROMPTS[:2], 12, ignore_eos=True, method="tree", tree=TreeConfig(budget=6)).tokens
    assert tree == ar
