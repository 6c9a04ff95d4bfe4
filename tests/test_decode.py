"""Autoregressive decoding: sampling filters, the exact output distribution, EOS, seeds, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode.engine import Engine
from specjax.decode.sampling import SamplingConfig, processed_logits, sample, target_probs
from specjax.errors import SpecjaxError
from specjax.io.registry import LoadedModel
from specjax.models.cache import KVCache
from specjax.models.config import TransformerConfig
from specjax.models.transformer import forward, init_params

from stats import chi_square_pvalue

TINY = TransformerConfig(vocab_size=12, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=64, max_position_embeddings=64)


def _scaled_params(seed=0, scale=10.0):
    """Random params with embeddings scaled up so the next-token distribution is far from uniform."""
    params = init_params(TINY, jax.random.key(seed))
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * scale
    return params


@pytest.fixture(scope="module")
def tiny_model():
    return LoadedModel("tiny", TINY, _scaled_params(), tokenizer=None, eos_token_ids=(3,))


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    topk = processed_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert np.isfinite(np.asarray(topk[0])).tolist() == [True, True, False, False, False]
    # mass before each token: 0, .4, .7, .85, .95 -> top_p=0.7 keeps the first two, 0.71 the first three
    for top_p, kept in ((0.7, 2), (0.71, 3), (1e-6, 1)):
        p = np.asarray(target_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p)))[0]
        assert (p > 0).sum() == kept
        np.testing.assert_allclose(p[:kept], np.array([0.4, 0.3, 0.15][:kept]) / [0.4, 0.7, 0.85][kept - 1], rtol=1e-5)
    greedy = np.asarray(target_probs(logits, SamplingConfig()))
    assert greedy.tolist() == [[1.0, 0, 0, 0, 0]]


def _exact_two_token_marginals(params, prompt, sampling):
    """P(first token) and P(second token), enumerated with one forward per first token."""
    prompt_len = len(prompt)
    cache = KVCache.zeros(TINY, 1, 16)
    out = forward(params, TINY, jnp.asarray([prompt]), jnp.arange(prompt_len)[None], cache, jnp.zeros((1,), jnp.int32))
    p1 = np.asarray(target_probs(out.logits[:, -1], sampling))[0]
    seqs = jnp.asarray([prompt + [t] for t in range(TINY.vocab_size)])
    batch = KVCache.zeros(TINY, TINY.vocab_size, 16)
    nxt = forward(params, TINY, seqs, jnp.broadcast_to(jnp.arange(prompt_len + 1), seqs.shape), batch,
                  jnp.zeros((TINY.vocab_size,), jnp.int32))
    p2_given = np.asarray(target_probs(nxt.logits[:, -1], sampling))  # [V, V]
    return p1, p1 @ p2_given


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5),
                                      SamplingConfig(temperature=1.3, top_p=0.8)])
def test_sampled_tokens_follow_the_exact_distribution(tiny_model, sampling):
    prompt = [1, 5, 2]
    p1, p2 = _exact_two_token_marginals(tiny_model.params, prompt, sampling)
    engine = Engine(tiny_model)
    n = 20_000
    out = engine.generate([prompt] * n, max_new_tokens=2, sampling=sampling, seed=1, ignore_eos=True).tokens
    out = np.asarray(out)
    assert chi_square_pvalue(np.bincount(out[:, 0], minlength=TINY.vocab_size), p1) > 1e-3
    assert chi_square_pvalue(np.bincount(out[:, 1], minlength=TINY.vocab_size), p2) > 1e-3


def test_a_broken_sampler_fails_the_same_test(tiny_model):
    """The statistical test has power: a sampler that forgets the temperature is caught."""
    sampling = SamplingConfig(temperature=0.7)
    prompt = [1, 5, 2]
    p1, _ = _exact_two_token_marginals(tiny_model.params, prompt, sampling)
    cache = KVCache.zeros(TINY, 1, 16)
    logits = forward(tiny_model.params, TINY, jnp.asarray([prompt]), jnp.arange(3)[None], cache,
                     jnp.zeros((1,), jnp.int32)).logits[:, -1]
    logits = jnp.broadcast_to(logits, (20_000, TINY.vocab_size))
    broken = sample(logits, jax.random.key(0), SamplingConfig(temperature=1.0))
    good = sample(logits, jax.random.key(0), sampling)
    assert chi_square_pvalue(np.bincount(np.asarray(broken), minlength=TINY.vocab_size), p1) < 1e-6
    assert chi_square_pvalue(np.bincount(np.asarray(good), minlength=TINY.vocab_size), p1) > 1e-3


def test_eos_stops_a_row_and_ignore_eos_does_not(tiny_model):
    engine = Engine(tiny_model)
    free = engine.generate([[1, 2]], max_new_tokens=20, ignore_eos=True).tokens[0]
    assert len(free) == 20
    eos = free[4]
    stopping = Engine(LoadedModel("tiny", TINY, tiny_model.params, None, (eos,)))
    out = stopping.generate([[1, 2], [1, 2]], max_new_tokens=20).tokens
    first = free.index(eos)
    assert out[0] == free[: first + 1]  # stops right after the first EOS, which is included
    assert out[1] == out[0]


def test_seeds_reproduce_and_differ(tiny_model):
    engine = Engine(tiny_model)
    s = SamplingConfig(temperature=1.0)
    a = engine.generate([[1, 2, 3]] * 4, 16, s, seed=7, ignore_eos=True).tokens
    b = engine.generate([[1, 2, 3]] * 4, 16, s, seed=7, ignore_eos=True).tokens
    c = engine.generate([[1, 2, 3]] * 4, 16, s, seed=8, ignore_eos=True).tokens
    assert a == b and a != c


def test_compiled_once_per_shape(tiny_model):
    engine = Engine(tiny_model)
    first = engine.generate([[1, 2, 3]], 8, ignore_eos=True).stats
    again = engine.generate([[4, 5]], 8, ignore_eos=True).stats  # same prompt bucket
    assert first["compile_s"] > 0 and again["compile_s"] == 0
    assert again["new_tokens"] == 8 and again["tokens_per_s"] > 0


@pytest.mark.parametrize("prompts,max_new,match", [
    ([[]], 4, "prompt 0 is empty"),
    ([[1, 2, 12]], 4, "token id 12 outside the vocabulary"),
    ([[1, -1]], 4, "token id -1 outside"),
    ([[1] * 60], 10, "beyond the model's context of 64"),
    ([[1]], 0, "max_new_tokens must be >= 1"),
    ([], 4, "no prompts"),
])
def test_bad_requests_are_refused(tiny_model, prompts, max_new, match):
    with pytest.raises(SpecjaxError, match=match):
        Engine(tiny_model).generate(prompts, max_new)


def test_bad_sampling_settings_are_refused():
    for kwargs, match in (({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")):
        with pytest.raises(SpecjaxError, match=match):
            SamplingConfig(**kwargs)


def test_streaming_in_chunks_gives_the_same_tokens(tiny_model):
    engine = Engine(tiny_model)
    whole = engine.generate([[1, 2, 3], [4]], 20, SamplingConfig(temperature=1.0), seed=5, ignore_eos=True)
    seen = []
    streamed = engine.generate([[1, 2, 3], [4]], 20, SamplingConfig(temperature=1.0), seed=5, ignore_eos=True,
                               on_tokens=seen.append, stream_every=6)
    assert streamed.tokens == whole.tokens
    # The prefill's token is shown at once (time to first token), then a chunk per 6 steps.
    assert [len(rows[0]) for rows in seen] == [1, 7, 13, 19, 20]
    assert all(rows[0] == whole.tokens[0][: len(rows[0])] for rows in seen)
