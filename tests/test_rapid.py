"""RAPID drafting (decode/rapid.py): the target drafts on a short retrieved context and verifies with
the full one. Lossless: greedy output is AR's whatever the drafting context, and sampled output
follows the target's exact distribution (a deliberately broken residual fails that check)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import slots
from specjax.decode.engine import Engine
from specjax.decode.rapid import RapidConfig
from specjax.errors import SpecjaxError

from stats import chi_square_pvalue
from test_decode import TINY
from test_speculative import SAMPLINGS, _exact_marginals

DOCUMENT = [3, 9, 4, 4, 1, 7, 7, 2, 8, 5, 1, 1, 6, 0, 9, 3, 2, 2, 4, 7, 5, 5, 8, 1]


def test_greedy_rapid_equals_ar_whatever_the_drafting_context(target):
    """Drafting contexts that are the whole prompt (self-speculation), a piece of it, and unrelated
    tokens: every output is AR's, and the closer the context, the more drafts are accepted."""
    prompts = [DOCUMENT + [1, 5, 2], DOCUMENT[:9] + [4, 4], DOCUMENT[5:] + [7]]
    engine = Engine(target)
    expected = engine.generate(prompts, 20).tokens
    taus = {}
    for name, contexts in (("whole", prompts), ("piece", [p[-6:] for p in prompts]),
                           ("unrelated", [[9, 9, 9, 0], [0, 1], [5]])):
        for drafts in (1, 3):
            out = engine.generate(prompts, 20, method="rapid", retrieval_prompts=contexts,
                                  rapid=RapidConfig(drafts=drafts))
            assert out.tokens == expected, (name, drafts)
            assert out.stats["rapid_drafts"] == drafts and out.stats["memory"]["retrieval_kv_bytes"] > 0
            taus[name, drafts] = out.stats["tau"]
    assert taus["whole", 3] > 3.5  # the target drafting on its own context is accepted almost always
    assert taus["whole", 3] > taus["unrelated", 3]
    with pytest.raises(SpecjaxError, match="retrieval_prompts"):
        engine.generate(prompts, 4, method="rapid")
    with pytest.raises(SpecjaxError, match="retrieval_prompts"):
        engine.generate(prompts, 4, method="rapid", retrieval_prompts=prompts[:1])


def _rapid_samples(target, sampling, prompt, context, count, depth, seed, drafts=2, eta=0.0):
    statics = slots.SlotStatics(TINY, slots.SlotConfig(slots=count, cache_length=32, max_new_tokens=depth,
                                                       steps_per_sync=1, insert_rows=count), (),
                                rapid=RapidConfig(drafts=drafts, eta=eta), retrieval_length=32)
    parts = slots.slot_parts(statics, target.params)
    full = lambda v, dt: jnp.full((count,), v, dt)  # noqa: E731
    request = slots.InsertRequest(
        rows=jnp.arange(count, dtype=jnp.int32), prompts=jnp.tile(jnp.asarray(prompt, jnp.int32), (count, 1)),
        prompt_lengths=full(len(prompt), jnp.int32), max_new_tokens=full(depth, jnp.int32),
        seeds=jnp.arange(count, dtype=jnp.uint32) + seed * count,
        sampling=slots.RowSampling(full(sampling.temperature, jnp.float32), full(sampling.top_k, jnp.int32),
                                   full(sampling.top_p, jnp.float32)),
        retrieval_prompts=jnp.tile(jnp.asarray(context, jnp.int32), (count, 1)),
        retrieval_prompt_lengths=full(len(context), jnp.int32))
    state = slots.insert(parts, slots.empty_slots(statics), request, statics=statics)
    state = slots.run_to_end(parts, state, method="rapid", statics=statics)
    return np.asarray(state.tokens[:, :depth]), np.asarray(state.accepted_histogram)


def _rapid_pvalues(target, seed):
    sampling, prompt, depth, count = SAMPLINGS[0], [1, 5, 2], 3, 10_000
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth)
    out, histogram = _rapid_samples(target, sampling, prompt, [5, 2], count, depth, seed)
    assert 0.05 < histogram[:, 1:].sum() / histogram.sum() < 0.99  # drafts both accepted and rejected
    return [chi_square_pvalue(np.bincount(out[:, i], minlength=TINY.vocab_size), exact[i]) for i in range(depth)]


def test_sampled_rapid_matches_the_exact_target_distribution(target):
    """Drafts from a different (shorter) context than the target's: each position's marginal over
    10,000 rows is the target's exact one."""
    for position, pvalue in enumerate(_rapid_pvalues(target, seed=3)):
        assert pvalue > 1e-3, f"token {position + 1}: p = {pvalue}"


def test_a_broken_residual_fails_the_rapid_distribution_check(target, monkeypatch):
    """Resampling a rejected draft from p instead of norm(max(p - q, 0)) over-weights the drafts'
    tokens: the same check sees it."""
    from specjax.decode import verify

    def broken_residual(draft, draft_probs, target_probs, rng):
        n, _ = verify.accept_sampled(draft, draft_probs, target_probs, rng)
        p_next = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]
        next_token = jax.random.categorical(jax.random.fold_in(rng, 1), jnp.log(p_next), axis=-1).astype(jnp.int32)
        return n, next_token

    monkeypatch.setattr(slots, "accept_sampled", broken_residual)
    jax.clear_caches()
    try:
        pvalues = _rapid_pvalues(target, seed=4)
    finally:
        jax.clear_caches()
    assert min(pvalues) < 1e-6, pvalues


def test_knowledge_transfer_moves_the_output_toward_the_drafts(target):
    """eta = 20 moves the second token's marginal from the target's toward the drafter's (the target
    reading the drafting context instead); eta = 0 keeps the target's. Greedy rows with transfer
    follow the shifted argmax, and the Engine labels the output lossy."""
    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    sampling, prompt, context, count = SAMPLINGS[0], [1, 5, 2], [7, 3], 10_000
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, 2)
    # The drafter's marginal of token 2: sum over x1 of p(x1 | prompt) q(x2 | context, x1).
    vocab = TINY.vocab_size
    seqs = np.concatenate([np.tile(context, (vocab, 1)), np.arange(vocab)[:, None]], axis=1)
    out = forward(target.params, TINY, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(3), seqs.shape),
                  KVCache.zeros(TINY, vocab, 8), jnp.zeros((vocab,), jnp.int32))
    drafter = exact[0] @ np.asarray(jax.nn.softmax(out.logits[:, -1]), np.float64)
    tv = lambda a, b: 0.5 * np.abs(a - b).sum()  # noqa: E731
    marginal = {}
    for eta in (0.0, 20.0):
        tokens, _ = _rapid_samples(target, sampling, prompt, context, count, 2, seed=5, eta=eta)
        marginal[eta] = np.bincount(tokens[:, 1], minlength=vocab) / count
    assert tv(exact[1], drafter) > 0.1  # the two contexts disagree enough to see a shift
    assert tv(marginal[0.0], exact[1]) < 0.03
    assert tv(marginal[20.0], drafter) < tv(marginal[0.0], drafter) - 0.05, (tv(marginal[20.0], drafter),
                                                                              tv(marginal[0.0], drafter))
    prompts = [DOCUMENT + [1, 5, 2]]
    lossless = Engine(target).generate(prompts, 12, method="rapid", retrieval_prompts=[[7, 3]])
    lossy = Engine(target).generate(prompts, 12, method="rapid", retrieval_prompts=[[7, 3]],
                                    rapid=RapidConfig(drafts=3, eta=50.0))
    assert "lossy" not in lossless.stats and "eta=50" in lossy.stats["lossy"]
    with pytest.raises(SpecjaxError, match="eta"):
        RapidConfig(eta=-1.0)


def test_rapid_block_drafts_from_the_drafting_prompt_and_stays_exact(target, drafter):
    """rapid+block: the block drafter reads the target's features of the drafting prompt only.
    Given the whole prompt as its drafting prompt it is the chain, step for step (the same accepted
    lengths); given a short piece of it, its drafter context is that much smaller, and the output
    is AR's either way."""
    prompts = [DOCUMENT * 2 + [1, 5, 2], DOCUMENT[:9] + [4, 4]]  # 51 tokens: a 128-slot cache
    engine = Engine(target, drafter)
    expected = engine.generate(prompts, 12).tokens
    chain = engine.generate(prompts, 12, method="chain")
    whole = engine.generate(prompts, 12, method="rapid+block", retrieval_prompts=prompts)
    piece = engine.generate(prompts, 12, method="rapid+block", retrieval_prompts=[p[-5:] for p in prompts])
    assert chain.tokens == whole.tokens == piece.tokens == expected
    assert whole.stats["accepted_length_histogram"] == chain.stats["accepted_length_histogram"]
    assert piece.stats["memory"]["drafter_state_bytes"] < chain.stats["memory"]["drafter_state_bytes"]
    with pytest.raises(SpecjaxError, match="retrieval_prompts"):
        engine.generate(prompts, 4, method="rapid+block")
    statics = slots.SlotStatics(TINY, slots.SlotConfig(slots=2), (), drafter.config, retrieval_length=64,
                                drafter_on_retrieval=True)
    with pytest.raises(SpecjaxError, match="full-prompt positions"):
        slots.check_method("chain", statics)
