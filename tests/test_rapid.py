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
            out = engine.generate(prompts, 20, method="rapid", drafting_prompts=contexts,
                                  rapid=RapidConfig(drafts=drafts))
            assert out.tokens == expected, (name, drafts)
            assert out.stats["rapid_drafts"] == drafts and out.stats["memory"]["drafting_kv_bytes"] > 0
            taus[name, drafts] = out.stats["tau"]
    assert taus["whole", 3] > 3.5  # the target drafting on its own context is accepted almost always
    assert taus["whole", 3] > taus["unrelated", 3]
    with pytest.raises(SpecjaxError, match="drafting_prompts"):
        engine.generate(prompts, 4, method="rapid")
    with pytest.raises(SpecjaxError, match="drafting_prompts"):
        engine.generate(prompts, 4, method="rapid", drafting_prompts=prompts[:1])


def test_rapid_drafts_unpadded_on_a_padded_target_and_stays_exact(target, monkeypatch):
    """A bf16 target padded to W query rows (the default on a CPU with bf16 dots) verifies rapid's
    drafts at W rows like its AR steps, so the output is AR's; the drafting passes, which need no
    exactness, run unpadded (at 8k an unpadded pass cost about 0.8x a padded one)."""
    from specjax.decode import rapid as rapid_module
    from specjax.io.registry import at_compute_dtype, with_query_rows

    padded = with_query_rows(at_compute_dtype(target, "bfloat16"), 4)
    drafting_rows = []
    real_forward = rapid_module.forward

    def recording_forward(params, config, *args, **kwargs):
        drafting_rows.append(config.query_rows)
        return real_forward(params, config, *args, **kwargs)

    monkeypatch.setattr(rapid_module, "forward", recording_forward)
    prompts = [DOCUMENT + [1, 5, 2], DOCUMENT[5:] + [7]]
    engine = Engine(padded)
    expected = engine.generate(prompts, 16, ignore_eos=True).tokens
    out = engine.generate(prompts, 16, ignore_eos=True, method="rapid", drafting_prompts=prompts,
                          rapid=RapidConfig(drafts=3))
    assert out.tokens == expected
    assert out.stats["tau"] > 2  # drafting on its own context, the target's drafts are accepted
    assert drafting_rows and set(drafting_rows) == {None}


def _rapid_samples(target, sampling, prompt, context, count, depth, seed, drafts=2, eta=0.0):
    statics = slots.SlotStatics(TINY, slots.SlotConfig(slots=count, cache_length=32, max_new_tokens=depth,
                                                       steps_per_sync=1, insert_rows=count), (),
                                rapid=RapidConfig(drafts=drafts, eta=eta), drafting_length=32)
    parts = slots.slot_parts(statics, target.params)
    full = lambda v, dt: jnp.full((count,), v, dt)  # noqa: E731
    request = slots.InsertRequest(
        rows=jnp.arange(count, dtype=jnp.int32), prompts=jnp.tile(jnp.asarray(prompt, jnp.int32), (count, 1)),
        prompt_lengths=full(len(prompt), jnp.int32), max_new_tokens=full(depth, jnp.int32),
        seeds=jnp.arange(count, dtype=jnp.uint32) + seed * count,
        sampling=slots.RowSampling(full(sampling.temperature, jnp.float32), full(sampling.top_k, jnp.int32),
                                   full(sampling.top_p, jnp.float32)),
        drafting_prompts=jnp.tile(jnp.asarray(context, jnp.int32), (count, 1)),
        drafting_prompt_lengths=full(len(context), jnp.int32))
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


@pytest.mark.slow  # 32 s; opt-in and lossy: the default suite keeps rapid's lossless checks
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
    lossless = Engine(target).generate(prompts, 12, method="rapid", drafting_prompts=[[7, 3]])
    lossy = Engine(target).generate(prompts, 12, method="rapid", drafting_prompts=[[7, 3]],
                                    rapid=RapidConfig(drafts=3, eta=50.0))
    assert "lossy" not in lossless.stats and "eta=50" in lossy.stats["lossy"]
    with pytest.raises(SpecjaxError, match="eta"):
        RapidConfig(eta=-1.0)


def _first_difference(out, want) -> int:
    return next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), min(len(out), len(want)))


def test_lossy_transfer_reports_where_each_output_leaves_the_lossless_run(target):
    """Under knowledge transfer (eta > 0), a greedy row records the first token that is not the
    target's own greedy choice. Greedy rapid at eta = 0 is AR, so that is where the output first
    differs from AR's: checked through the Engine's stats and through a server's request metrics
    and agreement gauge."""
    from specjax.serve.scheduler import Request, Scheduler

    prompts = [DOCUMENT + [1, 5, 2], DOCUMENT[5:] + [7], DOCUMENT[:9] + [4, 4]]
    drafting = [[7, 3], [9, 9, 0], DOCUMENT[:9] + [4, 4]]
    depth, lossy_config = 16, RapidConfig(drafts=3, eta=50.0)
    expected = Engine(target).generate(prompts, depth, ignore_eos=True).tokens
    lossy = Engine(target).generate(prompts, depth, ignore_eos=True, method="rapid", drafting_prompts=drafting,
                                    rapid=lossy_config)
    agreement = lossy.stats["lossless_agreement"]
    for out, want, prefix, identical in zip(lossy.tokens, expected, agreement["prefix_tokens"],
                                            agreement["identical"]):
        assert prefix == _first_difference(out, want) and identical == (out == want)
    assert not all(agreement["identical"])  # the transfer changed an output, so the check can fail

    config = _rapid_config("rapid")
    scheduler = Scheduler(target, None, config.__class__(**{**config.__dict__, "rapid": lossy_config}),
                          compile_now=False)
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=depth, temperature=0.0, drafting_prompt=tuple(d)))
                   for p, d in zip(prompts, drafting)]
        results = [h.result(timeout=300) for h in handles]
        ratio = scheduler.metrics.registry.get_sample_value("specjax:lossy_agreement_ratio")
    finally:
        scheduler.shutdown()
    identical = 0
    for result, want in zip(results, expected):
        reported = result.metrics["lossless_agreement"]
        assert "eta=50" in result.metrics["lossy"]
        assert reported["prefix_tokens"] == _first_difference(result.token_ids, want)
        assert reported["identical"] == (result.token_ids == want[: len(result.token_ids)])
        identical += reported["identical"]
    assert ratio == identical / len(results)


@pytest.mark.slow  # 20 s; the served rapid+block test checks its exactness by default
def test_rapid_block_drafts_from_the_drafting_prompt_and_stays_exact(target, drafter):
    """rapid+block: the block drafter reads the target's features of the drafting prompt only.
    Given the whole prompt as its drafting prompt it is the chain, step for step (the same accepted
    lengths); given a short piece of it, its drafter context is that much smaller, and the output
    is AR's either way."""
    prompts = [DOCUMENT * 2 + [1, 5, 2], DOCUMENT[:9] + [4, 4]]  # 51 tokens: a 128-slot cache
    engine = Engine(target, drafter)
    expected = engine.generate(prompts, 12).tokens
    chain = engine.generate(prompts, 12, method="chain")
    whole = engine.generate(prompts, 12, method="rapid+block", drafting_prompts=prompts)
    piece = engine.generate(prompts, 12, method="rapid+block", drafting_prompts=[p[-5:] for p in prompts])
    assert chain.tokens == whole.tokens == piece.tokens == expected
    assert whole.stats["accepted_length_histogram"] == chain.stats["accepted_length_histogram"]
    assert piece.stats["memory"]["drafter_state_bytes"] < chain.stats["memory"]["drafter_state_bytes"]
    with pytest.raises(SpecjaxError, match="drafting_prompts"):
        engine.generate(prompts, 4, method="rapid+block")
    statics = slots.SlotStatics(TINY, slots.SlotConfig(slots=2), (), drafter.config, drafting_length=64,
                                drafter_on_retrieval=True)
    with pytest.raises(SpecjaxError, match="full-prompt positions"):
        slots.check_method("chain", statics)


# ---- serving: a drafting prompt per request, and documents over HTTP ----

def _rapid_config(method, **kw):
    from specjax.serve.scheduler import ServeConfig

    return ServeConfig(method=method, slots=2, context_length=64, max_new_tokens=16, steps_per_sync=2,
                       prompt_bucket=16, drafting_length=64, rapid=RapidConfig(drafts=3), **kw)


@pytest.mark.parametrize("method", ["rapid", "rapid+block"])
def test_served_rapid_requests_with_their_own_drafting_prompts_equal_ar(target, drafter, method):
    """Four requests through two slots, each drafting from its own drafting prompt (the whole
    prompt, a piece of it, unrelated tokens, none given: the prompt itself): every output is AR's,
    rows refilled as others finish, and each request reports its drafting prompt's size. The rapid
    server compiles ahead (its inserts at start, its drafting-context fills on the background
    thread), so once that thread is done its requests build no program."""
    from specjax.serve.scheduler import Request, Scheduler

    prompts = [DOCUMENT + [1, 5, 2], DOCUMENT[:9] + [4, 4], DOCUMENT[5:] + [7], DOCUMENT[:12]]
    drafting = [tuple(prompts[0]), tuple(prompts[1][-5:]), (9, 9, 0), None]
    limits = [16, 9, 12, 16]
    expected = Engine(target).generate(prompts, 16).tokens
    ahead = method == "rapid"
    scheduler = Scheduler(target, drafter if method == "rapid+block" else None, _rapid_config(method),
                          compile_now=ahead)
    if ahead:  # moving a row between slots is a small program, compiled on first use on every server
        assert scheduler.wait_compiled(timeout=600)  # the drafting-context fills compile in the background
        assert {key for key in scheduler.programs.compiled if key[0] == "drafting"} == {
            ("drafting", bucket, rows) for bucket in scheduler.shapes.drafting_buckets for rows in scheduler.shapes.insert_sizes}
        built = scheduler.programs.program
        scheduler.programs.program = lambda kind, **static: built(kind, **static) if kind == "move_row" else pytest.fail(
            f"a {kind} program was built while serving")
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=n, temperature=0.0, drafting_prompt=d))
                   for p, d, n in zip(prompts, drafting, limits)]
        results = [h.result(timeout=300) for h in handles]
        for result, want, limit, prompt, draft in zip(results, expected, limits, prompts, drafting):
            assert result.token_ids == want[:limit]
            assert result.metrics["drafting_prompt_tokens"] == len(prompt if draft is None else draft)
            assert result.metrics["speculative_decoding"]["verify_steps"] >= 1
        if method == "rapid":  # the target drafting on its own prompt is accepted almost always
            assert results[0].metrics["speculative_decoding"]["mean_acceptance_length"] > 2.5
        with pytest.raises(SpecjaxError, match="drafting context"):
            scheduler.validate(Request((1, 2), max_tokens=16, drafting_prompt=tuple(range(10)) * 5))
        with pytest.raises(SpecjaxError, match="outside the vocabulary"):
            scheduler.validate(Request((1, 2), max_tokens=4, drafting_prompt=(99,)))
    finally:
        scheduler.shutdown()


@pytest.fixture(scope="module")
def worded():
    """A tiny random target that reads text: SmolLM2's tokenizer over a vocabulary of its size."""
    import dataclasses

    from specjax.io.gguf import _open, gguf_tokenizer
    from specjax.io.registry import LoadedModel, fetch_packaged_model
    from specjax.models.transformer import init_params

    path = fetch_packaged_model("smollm2")
    tokenizer = gguf_tokenizer(_open(path), str(path))
    config = dataclasses.replace(TINY, vocab_size=49152, max_position_embeddings=1024)
    params = init_params(config, jax.random.key(1))
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * 10.0
    return LoadedModel("tiny-text", config, params, tokenizer, tuple(tokenizer.eos_token_ids))


FILLER = ["The rain kept on through the afternoon.", "She walked to the village and back again.",
          "Letters arrived from town every other week.", "The garden wall needed mending before winter.",
          "Dinner was late, and nobody minded much.", "His brother wrote of horses and of debts."]


def _needle_document(repeats: int = 6) -> str:
    sentences = [FILLER[i % len(FILLER)] for i in range(repeats * len(FILLER))]
    sentences.insert(len(sentences) * 2 // 3, "The secret password of the house is marmalade.")
    return " ".join(sentences)


def test_document_requests_over_http_draft_from_retrieved_chunks_and_equal_ar(worded):
    """POST /v1/completions and /v1/chat/completions with a `document`: the target reads document
    and question, the rapid server drafts from the chunks BM25 retrieved for the question, the
    output is AR's on the same prompt, the response says what was retrieved, and a second request
    about the same document finds its index cached."""
    from fastapi.testclient import TestClient

    from specjax.data.retrieval import RetrievalConfig, long_context_prompt
    from specjax.serve.http import create_app
    from specjax.serve.scheduler import Scheduler, ServeConfig

    retrieval = RetrievalConfig(retriever="bm25", chunk_tokens=32, budget_tokens=64, min_score=0.0)
    config = ServeConfig(method="rapid", slots=2, context_length=512, max_new_tokens=8, prompt_bucket=64,
                         drafting_length=192, rapid=RapidConfig(drafts=3), retrieval=retrieval)
    scheduler = Scheduler(worded, None, config, compile_now=False)
    document, question = _needle_document(), "What is the secret password?"
    try:
        client = TestClient(create_app(scheduler))
        body = {"prompt": question, "document": document, "max_tokens": 8, "temperature": 0}
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        out = first.json()
        full = long_context_prompt(worded.tokenizer, document, question, chat=False).full
        assert out["choices"][0]["token_ids"] == Engine(worded).generate([full], 8).tokens[0]
        picked = out["metrics"]["retrieval"]
        assert picked["retriever"] == "bm25" and 0 < len(picked["selected_chunks"]) < picked["chunks"]
        assert picked["index_build_s"] > 0 and out["usage"]["prompt_tokens"] == len(full)
        assert out["metrics"]["drafting_prompt_tokens"] < len(full)
        again = client.post("/v1/completions", json=body).json()
        assert again["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]
        assert again["metrics"]["retrieval"]["index_build_s"] == 0  # the document's index was cached
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}],
            "document": document, "max_tokens": 8, "temperature": 0, "retrieval": {"top_k": 1}})
        assert chat.status_code == 200, chat.text
        assert len(chat.json()["metrics"]["retrieval"]["selected_chunks"]) == 1
        for bad, message in (({**body, "document": 7}, "'document' must be a non-empty string"),
                             ({**body, "prompt": [1, 2]}, "give the prompt (the question) as a string"),
                             ({**body, "retrieval": {"k": 2}}, "unknown retrieval setting 'k'"),
                             ({**body, "retrieval": {"retriever": "tfidf"}}, "unknown retriever")):
            response = client.post("/v1/completions", json=bad)
            assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    finally:
        scheduler.shutdown()


def test_re_retrieval_rebuilds_the_drafting_context_and_stays_exact(target):
    """Rows that start from an unrelated drafting prompt and re-retrieve every 4 tokens (here: their
    whole prompt) draft better afterwards, and the output is still AR's; prompt_for sees each row's
    generated tokens so far, and a prompt longer than promised is refused."""
    from specjax.data.retrieval import Redraft

    prompts = [DOCUMENT + [1, 5, 2], DOCUMENT[:9] + [4, 4]]
    engine = Engine(target)
    expected = engine.generate(prompts, 20).tokens
    unrelated = [[9, 9, 9, 0], [5]]
    seen = []

    def prompt_for(row, generated):
        seen.append((row, list(generated)))
        return prompts[row]

    redraft = Redraft(every=4, prompt_for=prompt_for, max_prompt_tokens=len(prompts[0]))
    config = RapidConfig(drafts=3)
    stale = engine.generate(prompts, 20, method="rapid", drafting_prompts=unrelated, rapid=config)
    fresh = engine.generate(prompts, 20, method="rapid", drafting_prompts=unrelated, rapid=config, redraft=redraft)
    assert stale.tokens == fresh.tokens == expected
    assert fresh.stats["redrafts"] == len(seen) >= 2 and fresh.stats["redraft_s"] > 0
    # Only each row's first refresh changes its context (unrelated -> its prompt) and prefills it,
    # whole, since nothing is shared; later ones find the same prompt and prefill nothing.
    first = {row: generated for row, generated in reversed(seen)}
    assert fresh.stats["redraft_prefill_tokens"] == sum(len(prompts[row]) + len(g) - 1 for row, g in first.items())
    assert fresh.stats["tau"] > stale.stats["tau"]
    for row, generated in seen:  # each call saw a prefix of the row's output, at least `every` long
        assert len(generated) >= 4 and expected[row][: len(generated)] == generated
    # A prompt longer than promised would not fit the drafting context: the row keeps its own.
    too_long = Redraft(every=4, prompt_for=lambda row, generated: prompts[0] * 2, max_prompt_tokens=len(prompts[0]))
    kept = engine.generate(prompts, 20, method="rapid", drafting_prompts=unrelated, rapid=config, redraft=too_long)
    assert kept.tokens == expected and kept.stats["redrafts"] == 0
    with pytest.raises(SpecjaxError, match="applies to rapid"):
        engine.generate(prompts, 4, method="ar", redraft=redraft)


def test_a_refresh_that_keeps_a_shared_prefix_fills_the_drafting_cache_as_a_whole_refill_does(target):
    """refresh_drafting with starts (rapid): rows keep their drafting K/V before where the new
    sequence differs and prefill only the rest; the cache, lengths and previous tokens equal a
    whole refill's. Keeping one token too many leaves the old token's K/V there, and differs."""
    count, old = 2, [DOCUMENT[:10], DOCUMENT[4:12]]
    new = [old[0][:6] + [0, 0, 1], old[1][:3] + [6, 9, 9, 4, 4, 0]]  # they differ from slots 6 and 3 on
    statics = slots.SlotStatics(TINY, slots.SlotConfig(slots=count, cache_length=32, max_new_tokens=4,
                                                       steps_per_sync=1, insert_rows=count), (),
                                rapid=RapidConfig(drafts=2), drafting_length=32)
    parts = slots.slot_parts(statics, target.params)
    full = lambda v, dt: jnp.full((count,), v, dt)  # noqa: E731
    rows = jnp.arange(count, dtype=jnp.int32)
    request = slots.InsertRequest(
        rows=rows, prompts=jnp.tile(jnp.asarray([1, 5, 2], jnp.int32), (count, 1)), prompt_lengths=full(3, jnp.int32),
        max_new_tokens=full(4, jnp.int32), seeds=jnp.arange(count, dtype=jnp.uint32),
        sampling=slots.RowSampling(full(0.0, jnp.float32), full(0, jnp.int32), full(1.0, jnp.float32)),
        drafting_prompts=jnp.asarray(slots.token_rows(old, 16)),
        drafting_prompt_lengths=jnp.asarray([len(p) for p in old], jnp.int32))
    inserted = slots.insert(parts, slots.empty_slots(statics), request, statics=statics)
    copy = lambda: jax.tree.map(jnp.copy, inserted)  # noqa: E731 - the refresh donates its state
    lengths = jnp.asarray([len(p) for p in new], jnp.int32)
    whole = slots.refresh_drafting(parts, copy(), rows, jnp.asarray(slots.token_rows(new, 16)), lengths,
                                   statics=statics)

    def extended(starts):
        suffixes = jnp.asarray(slots.token_rows([p[s:] for p, s in zip(new, starts)], 8))
        return slots.refresh_drafting(parts, copy(), rows, suffixes, lengths, jnp.asarray(starts, jnp.int32),
                                      statics=statics)

    def cache_gap(state):
        return max(float(jnp.abs(a[r, :n].astype(jnp.float32) - b[r, :n].astype(jnp.float32)).max())
                   for a, b in zip(jax.tree.leaves(state.drafting_cache), jax.tree.leaves(whole.drafting_cache))
                   for r, n in enumerate(np.asarray(lengths)))

    kept = extended([6, 3])
    np.testing.assert_array_equal(kept.drafting_lengths, whole.drafting_lengths)
    np.testing.assert_array_equal(kept.drafting_previous, whole.drafting_previous)
    assert cache_gap(kept) < 1e-5
    assert cache_gap(extended([7, 3])) > 1e-3  # row 0's slot 6 still holds the old token's K/V
    with pytest.raises(SpecjaxError, match="only rapid"):
        rapid_block = slots.SlotStatics(TINY, statics.slot, (), drafting_length=32)
        slots.refresh_drafting(parts, copy(), rows, jnp.zeros((count, 8), jnp.int32), lengths,
                               jnp.zeros((count,), jnp.int32), statics=rapid_block)
