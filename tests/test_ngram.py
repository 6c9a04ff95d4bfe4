"""Prompt lookup (the ngram method): its proposer against a plain-Python reference, and exactness on
the serving step: greedy output equals AR token for token; sampled output matches the target's
exactly enumerated distribution, and a broken acceptance rule in the same step fails that test."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import slots
from specjax.decode.engine import Engine
from specjax.decode.ngram import NgramConfig, propose_ngram, propose_ngram_numpy, propose_ngram_reference
from specjax.errors import SpecjaxError

from stats import chi_square_pvalue
from test_decode import TINY
from test_speculative import SAMPLINGS, _broken_impl, _exact_marginals

REPEATING = [[1, 5, 2, 1, 5], [7, 8, 7, 8, 7], [4, 4, 9, 10, 11, 0, 2]]


def test_reference_proposer_on_hand_made_contexts():
    config = NgramConfig(drafts=3, max_n=3, min_n=1)
    assert propose_ngram_reference([1, 2, 3, 9, 1, 2], config) == [3, 9, 1]  # "1 2" matched at the start
    assert propose_ngram_reference([5, 1, 2, 7, 1, 2, 8, 1, 2], config) == [8, 1, 2]  # the latest match
    assert propose_ngram_reference([1, 2, 3], config) == []  # no earlier occurrence
    assert propose_ngram_reference([3, 1, 2, 4, 1, 2], NgramConfig(drafts=2, max_n=2, min_n=2)) == [4, 1]
    assert propose_ngram_reference([9, 4, 9], NgramConfig(drafts=5, max_n=2, min_n=1)) == [4, 9]  # runs to the end
    # The longest n-gram wins over a more recent shorter one.
    assert propose_ngram_reference([1, 2, 3, 5, 3, 6, 1, 2, 3], NgramConfig(drafts=1, max_n=3, min_n=1)) == [5]
    with pytest.raises(SpecjaxError, match="max_n"):
        NgramConfig(max_n=1, min_n=2)


def test_device_proposer_matches_the_reference():
    rng = np.random.default_rng(0)
    config = NgramConfig(drafts=4, max_n=3, min_n=1)
    history = rng.integers(0, 5, (64, 40)).astype(np.int32)  # a small vocabulary: many matches
    lengths = rng.integers(0, 39, 64).astype(np.int32)
    last = rng.integers(0, 5, 64).astype(np.int32)
    drafts, available = (np.asarray(a) for a in propose_ngram(jnp.asarray(history), jnp.asarray(lengths),
                                                              jnp.asarray(last), config))
    want_drafts, want_available = propose_ngram_numpy(history, lengths, last, config)
    np.testing.assert_array_equal(available, want_available)
    assert 0 < (available > 0).mean() < 1
    for row, count in enumerate(want_available):
        np.testing.assert_array_equal(drafts[row, :count], want_drafts[row, :count])


def test_greedy_ngram_equals_autoregressive(target):
    engine = Engine(target)
    ar = engine.generate(REPEATING, 30, ignore_eos=True)
    ngram = engine.generate(REPEATING, 30, ignore_eos=True, method="ngram", ngram=NgramConfig(drafts=4))
    assert ngram.tokens == ar.tokens
    assert ngram.stats["tau"] > 1.2, "a tiny target's greedy output loops, so lookups should be accepted"
    assert ngram.stats["draft_tokens"] > 0
    # With EOS the outputs still agree (the step stops where AR stops).
    assert engine.generate(REPEATING, 30, method="ngram").tokens == engine.generate(REPEATING, 30).tokens


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_ngram_matches_the_exact_target_distribution(target, broken, monkeypatch):
    prompt, depth, sampling = REPEATING[0], 3, SAMPLINGS[0]
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth)
    if broken:  # the same slot step with the residual rule broken; its own config, so it is traced anew
        monkeypatch.setattr(slots, "accept_sampled", _broken_impl)
    config = NgramConfig(drafts=3 if broken else 4, max_n=2, min_n=1)
    result = Engine(target).generate([prompt] * 20_000, depth, sampling, seed=5, ignore_eos=True, method="ngram",
                                     ngram=config)
    out = np.asarray(result.tokens)
    pvalues = [chi_square_pvalue(np.bincount(out[:, i], minlength=TINY.vocab_size), exact[i]) for i in range(depth)]
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert 0.05 < result.stats["per_position_acceptance"][0] < 0.95  # accepted and rejected drafts
        assert min(pvalues) > 1e-3, pvalues
