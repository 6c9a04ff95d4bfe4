"""Serving: the slot-level step API, continuous batching and the OpenAI-compatible server.

Exactness first: a greedy request decoded in a slot, with others joining and leaving around it,
gives the tokens of `Engine.generate`; sampled rows follow the target's exact distribution, and a
broken acceptance rule fails that check. Then the API contract over real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import slots
from specjax.decode.engine import Engine
from specjax.decode.sampling import SamplingConfig
from specjax.decode.tree import TreeConfig
from specjax.errors import SpecjaxError
from specjax.io.registry import LoadedModel
from specjax.serve.scheduler import QueueFull, Request, Scheduler, ServeConfig

from rounding import assert_rounding_close
from stats import chi_square_pvalue
from test_decode import TINY
from test_refiner import _perturbed
from test_speculative import SAMPLINGS, _broken_impl, _exact_marginals

PROMPTS = [[1, 5, 2], [7], [4, 4, 9, 10, 11, 0, 2], [2, 2], [9, 1, 1, 1, 8], [6, 5]]


def _config(method, slot_count=2, **kw):
    return ServeConfig(method=method, slots=slot_count, context_length=64, max_new_tokens=24, steps_per_sync=3,
                       prompt_bucket=16, **kw)


@pytest.fixture(scope="module")
def chain_scheduler(target, drafter):
    scheduler = Scheduler(target, drafter, _config("chain"))
    yield scheduler
    scheduler.shutdown()


@pytest.mark.parametrize("method", ["ar", "chain"])
def test_greedy_requests_through_slots_equal_generate(target, drafter, chain_scheduler, method):
    """Six requests through two slots: rows are refilled as others finish, with ragged lengths and
    limits, and each output is Engine.generate's for that prompt alone."""
    # Schedulers built with compile_now=False share jit's cache: the AR tests below compile once.
    scheduler = chain_scheduler if method == "chain" else Scheduler(target, None, _config("ar"), compile_now=False)
    limits = [20, 5, 17, 24, 1, 9]
    handles = [scheduler.submit(Request(tuple(p), max_tokens=n, temperature=0.0)) for p, n in zip(PROMPTS, limits)]
    results = [h.result(timeout=120) for h in handles]
    # Greedy output under a smaller limit is the prefix of the output under the largest one.
    longest = Engine(target, drafter).generate(PROMPTS, max(limits), method=method).tokens
    for prompt, limit, result, whole in zip(PROMPTS, limits, results, longest):
        expected = whole[:limit]
        assert result.token_ids == expected, (prompt, limit)
        assert result.finish_reason == ("stop" if expected[-1] in target.eos_token_ids else "length")
        assert result.metrics["precision"] == {"dtype": "float32", "kv_dtype": "float32", "query_rows": None}
    if method == "chain":
        spec = results[0].metrics["speculative_decoding"]
        tau = spec["mean_acceptance_length"]
        assert spec["verify_steps"] >= 1 and tau == pytest.approx(1 + sum(spec["per_position_acceptance"]))
        # The steps committed at least every token after the prefill's first (the last step may pass the limit).
        assert tau * spec["verify_steps"] >= len(results[0].token_ids) - 1 and tau <= drafter.config.block_size
        assert len(spec["per_position_acceptance"]) == drafter.config.block_size - 1
        assert sum(spec["acceptance_histogram"]) == spec["verify_steps"]
    else:
        scheduler.shutdown()


def test_compiling_the_server_reports_each_program_as_it_goes(target, capfd):
    """A start that compiles for minutes says so program by program (k of n), not only at the end."""
    scheduler = Scheduler(target, None, _config("ar", prefill_chunk=8))
    try:
        lines = [line for line in capfd.readouterr().err.splitlines() if "compiling the server's programs" in line]
        total = len(scheduler.shapes.attend_buckets) * len(scheduler.shapes.row_buckets) + \
            len(scheduler.shapes.insert_sizes) * len(scheduler.shapes.prompt_buckets) + 1
        assert [line.split(": ")[1].split(" ")[0] for line in lines] == [f"{k}/{total}" for k in range(1, total + 1)]
        assert any("ar step" in line for line in lines) and any("insert" in line for line in lines)
        assert "chunked prefill" in lines[-1]
    finally:
        scheduler.shutdown()


def test_long_prompts_are_prefilled_in_chunks_while_others_decode(target, drafter, monkeypatch):
    """With prefill_chunk 24, prompts longer than 24 tokens enter their slots a chunk per scheduler
    turn while the other slot decodes, and every greedy output is still generate's. The 50-token
    prompt nearly fills the 64-slot cache: a padded last chunk at offset 48 would run off its end."""
    scheduler = Scheduler(target, drafter, _config("chain", prefill_chunk=24), compile_now=False)
    chunks: list[tuple[int, int]] = []  # (request id, tokens prefilled after the call)
    prefill = scheduler.admission.prefill

    def counted(batch):
        prefill(batch)
        chunks.extend((live.handle.id, live.prefilled) for _, live in batch)
    monkeypatch.setattr(scheduler.admission, "prefill", counted)
    prompts = [[(7 * i + j) % TINY.vocab_size for j in range(n)] for i, n in enumerate((11, 50, 3, 30))]
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=8, temperature=0.0)) for p in prompts]
        results = [h.result(timeout=120) for h in handles]
    finally:
        scheduler.shutdown()
    expected = Engine(target, drafter).generate(prompts, 8, method="chain").tokens
    assert [r.token_ids for r in results] == expected
    for handle, prompt in zip(handles, prompts):
        steps = [n for rid, n in chunks if rid == handle.id]
        # The first chunk is the remainder, then whole chunks of 24 up to the prompt's end.
        assert steps == list(range(len(prompt) % 24 or 24, len(prompt) + 1, 24)), steps


def test_a_windowed_drafter_serves_exactly(target, drafter):
    """Windowed chain through the slots (bounded drafter state: ring, pending segment, summaries),
    with prompts long enough to finish segments at prefill and while decoding; prompts are prefilled
    whole (chunking is off for windowed drafters)."""
    from specjax.models.drafter import DrafterWindow
    from test_windowed_drafter import with_random_compressor

    windowed = with_random_compressor(drafter, DrafterWindow(window=5, segment=4, summaries=2))
    scheduler = Scheduler(target, windowed, _config("chain", prefill_chunk=4), compile_now=False)
    assert scheduler.shapes.prefill_chunk == 0
    prompts = [[1, 5, 2, 7, 7, 1, 9, 4, 2, 2, 6], [3, 4], [8, 1, 1, 2, 9, 9, 3]]
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=20, temperature=0.0)) for p in prompts]
        results = [h.result(timeout=120).token_ids for h in handles]
    finally:
        scheduler.shutdown()
    assert results == Engine(target).generate(prompts, 20).tokens


def test_waiting_requests_are_prefilled_together(target, drafter, monkeypatch):
    """Three requests queued at once enter three free slots in one insert call, and each still
    decodes exactly as it would alone."""
    scheduler = Scheduler(target, drafter, _config("chain", slot_count=3, insert_rows=3), compile_now=False)
    calls = []
    admission = scheduler.admission
    prefill = admission.prefill
    monkeypatch.setattr(admission, "prefill", lambda batch: (calls.append(len(batch)), prefill(batch)))
    admit = admission.admit
    monkeypatch.setattr(admission, "admit", lambda: False)  # hold admission while the queue fills
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=12, temperature=0.0)) for p in PROMPTS[:3]]
        monkeypatch.setattr(admission, "admit", admit)
        scheduler._wake()
        results = [h.result(timeout=120).token_ids for h in handles]
    finally:
        scheduler.shutdown()
    assert calls == [3]
    assert results == Engine(target, drafter).generate(PROMPTS[:3], 12, method="chain").tokens


def test_steps_compute_only_the_rows_in_use_after_packing_them(target, drafter, monkeypatch):
    """With 4 slots and row buckets (1, 4): while three requests run, steps compute 4 rows; once the
    two short ones end, the long one moves to slot 0 and steps compute 1 row. Outputs stay generate's."""
    scheduler = Scheduler(target, drafter, _config("chain", slot_count=4, row_buckets=(1,)), compile_now=False)
    assert scheduler.shapes.row_buckets == (1, 4)
    stepped, moved = [], []
    programs = scheduler.programs
    compiled_step, program = programs.step, programs.program
    monkeypatch.setattr(programs, "step", lambda policy, length, rows: (
        stepped.append(rows), compiled_step(policy, length, rows))[1])

    def recorded(kind, **static):
        run = program(kind, **static)
        if kind != "move_row":
            return run
        return lambda state, source, target: (moved.append((source, target)), run(state, source, target))[1]

    monkeypatch.setattr(programs, "program", recorded)
    prompts, limits = PROMPTS[:3], [3, 24, 2]  # the long request sits in slot 1, between two short ones
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=n, temperature=0.0)) for p, n in zip(prompts, limits)]
        results = [h.result(timeout=120).token_ids for h in handles]
    finally:
        scheduler.shutdown()
    assert stepped[0] == 4 and stepped[-1] == 1, stepped
    assert moved == [(1, 0)]
    expected = Engine(target, drafter).generate(prompts, max(limits), method="chain").tokens
    assert results == [whole[:n] for whole, n in zip(expected, limits)]


def test_streamed_chunks_add_up_to_the_result(chain_scheduler):
    handle = chain_scheduler.submit(Request((1, 5, 2), max_tokens=20, temperature=0.0))
    chunks = list(handle)
    assert len(chunks) >= 2, "a 20-token answer over 3-step syncs arrives in several chunks"
    assert [t for c in chunks for t in c.token_ids] == handle.result().token_ids


def test_a_seeded_sampled_request_is_reproducible_whatever_shares_the_batch(chain_scheduler):
    request = Request((4, 4, 9), max_tokens=16, temperature=1.0, seed=1234)
    alone = chain_scheduler.submit(request).result(timeout=60).token_ids
    others = [chain_scheduler.submit(Request(tuple(p), max_tokens=12, temperature=0.7, seed=i))
              for i, p in enumerate(PROMPTS[:3])]
    again = chain_scheduler.submit(request)
    for h in others:
        h.result(timeout=60)
    assert again.result(timeout=60).token_ids == alone
    different = chain_scheduler.submit(Request((4, 4, 9), max_tokens=16, temperature=1.0, seed=99)).result(60)
    assert different.token_ids != alone


SMALL_TREES = TreeConfig(buckets=(1, 4, 8))
"""Auto-sized trees with few buckets, so the tiny tests measure and compile little."""


# tree+refiner runs every new code path (refined marginals, the tree step, measured costs); the
# other two are slow, for the default suite's time budget.
@pytest.mark.parametrize("method", [pytest.param("chain+refiner", marks=pytest.mark.slow),
                                    pytest.param("tree", marks=pytest.mark.slow), "tree+refiner", "ngram"])
def test_every_method_serves_greedy_requests_exactly(target, drafter, method, tmp_path):
    """Greedy requests through the refiner and tree steps, with sampled requests sharing the batch,
    give Engine.generate's AR tokens; the tree's budget rule runs on costs measured at the slot count."""
    refiner = _perturbed("gru", drafter) if method.endswith("refiner") else None
    scheduler = Scheduler(target, drafter, _config(method, slot_count=3, tree=SMALL_TREES), compile_now=False,
                          refiner=refiner, latency_cache=tmp_path)
    try:
        if scheduler.latency is not None:
            assert list(scheduler.latency.sizes) == [1, 4, 8] and scheduler.parts.tree_costs is not None
        limits = [20, 5, 17, 24]
        greedy = [scheduler.submit(Request(tuple(p), max_tokens=n, temperature=0.0)) for p, n in zip(PROMPTS, limits)]
        sampled = [scheduler.submit(Request(tuple(p), max_tokens=10, temperature=1.0, top_k=5, seed=i))
                   for i, p in enumerate(PROMPTS[4:])]
        results = [h.result(timeout=300) for h in greedy]
        assert all(h.result(timeout=300).finish_reason in ("length", "stop") for h in sampled)
    finally:
        scheduler.shutdown()
    expected = Engine(target).generate(PROMPTS[:4], max(limits)).tokens
    for limit, result, whole in zip(limits, results, expected):
        assert result.token_ids == whole[:limit]
    spec = results[0].metrics["speculative_decoding"]
    assert spec["verify_steps"] >= 1 and 0.0 <= spec["acceptance_rate"] <= 1.0 and spec["draft_tokens"] >= 1


@pytest.mark.parametrize("method", ["chain", pytest.param("tree+refiner", marks=pytest.mark.slow)])
def test_every_method_streams_through_the_slot_step(target, drafter, method, tmp_path):
    """Engine.generate with on_tokens drives the serving step: chunks grow, each a prefix of the
    final output, which is the non-streamed output."""
    refiner = _perturbed("gru", drafter) if method.endswith("refiner") else None
    engine = Engine(target, drafter, refiner=refiner, latency_cache=tmp_path)
    whole = engine.generate(PROMPTS[:3], 20, method=method, tree=SMALL_TREES)
    seen = []
    streamed = engine.generate(PROMPTS[:3], 20, method=method, tree=SMALL_TREES, on_tokens=seen.append,
                               stream_every=4)
    assert streamed.tokens == whole.tokens
    assert len(seen) >= 3 and seen[-1] == whole.tokens
    for earlier, later in zip(seen, seen[1:]):
        assert all(b[: len(a)] == a for a, b in zip(earlier, later))
    assert streamed.stats["streamed"] and streamed.stats["tau"] >= 1.0 and streamed.stats["draft_tokens"] >= 1


def _sample_through_slots(target, drafter, sampling: SamplingConfig, prompt, count, depth, seed, step_fn=None,
                          method="chain", refiner=None, tree=None):
    """count rows of one prompt decoded `depth` tokens by the slot API directly (one insert call)."""
    statics = slots.SlotStatics(TINY, slots.SlotConfig(slots=count, cache_length=64, max_new_tokens=depth,
                                                       steps_per_sync=depth, insert_rows=count), (),
                                drafter.config, refiner_config=None if refiner is None else refiner.config,
                                tree=tree)
    state = slots.empty_slots(statics)
    rows = lambda v, dt: jnp.full((count,), v, dt)  # noqa: E731
    request = slots.InsertRequest(
        rows=jnp.arange(count, dtype=jnp.int32), prompts=jnp.asarray([prompt] * count, jnp.int32),
        prompt_lengths=rows(len(prompt), jnp.int32), max_new_tokens=rows(depth, jnp.int32),
        seeds=jnp.arange(count, dtype=jnp.uint32) + seed * count,
        sampling=slots.RowSampling(rows(sampling.temperature, jnp.float32), rows(sampling.top_k, jnp.int32),
                                   rows(sampling.top_p, jnp.float32)))
    parts = slots.slot_parts(statics, target.params, drafter.params, None, None if refiner is None else refiner.params)
    state = slots.insert(parts, state, request, statics=statics)
    state = (step_fn or slots.step)(parts, state, method=method, statics=statics)
    assert bool(state.done.all())
    return np.asarray(state.tokens[:, :depth]), np.asarray(state.accepted_histogram)


@pytest.mark.parametrize("sampling", [SAMPLINGS[0], pytest.param(SAMPLINGS[1], marks=pytest.mark.slow)])
def test_sampled_slots_match_the_exact_target_distribution(target, drafter, sampling):
    prompt, depth = [1, 5, 2], 3
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth)
    out, histogram = _sample_through_slots(target, drafter, sampling, prompt, 10_000, depth, seed=5)
    accepted_first = histogram[:, 1:].sum() / histogram.sum()
    assert 0.1 < accepted_first < 0.99  # both branches of the acceptance rule exercised
    for position in range(depth):
        counts = np.bincount(out[:, position], minlength=TINY.vocab_size)
        assert chi_square_pvalue(counts, exact[position]) > 1e-3, f"token {position + 1}"


@pytest.mark.parametrize("method", ["chain+refiner", "tree+refiner"])
def test_refined_and_tree_slots_sample_the_exact_target_distribution(target, drafter, method):
    """Per-row Gumbel noise in the refiner and per-row draws at every tree node keep the output
    distribution the target's (a fixed 8-node tree: every draft slot is a node)."""
    sampling, prompt, depth = SAMPLINGS[0], [1, 5, 2], 3
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth)
    tree = TreeConfig(budget=8) if method.startswith("tree") else None
    out, histogram = _sample_through_slots(target, drafter, sampling, prompt, 10_000, depth, seed=7, method=method,
                                           refiner=_perturbed("gru", drafter, scale=1.5), tree=tree)
    assert 0.05 < histogram[:, 1:].sum() / histogram.sum() < 0.99
    for position in range(depth):
        counts = np.bincount(out[:, position], minlength=TINY.vocab_size)
        assert chi_square_pvalue(counts, exact[position]) > 1e-3, (method, position + 1)


def test_a_broken_acceptance_rule_fails_through_slots(target, drafter, monkeypatch):
    prompt, depth = [1, 5, 2], 2
    exact = _exact_marginals(target.params, np.asarray(prompt), SAMPLINGS[0], depth)
    monkeypatch.setattr(slots, "accept_sampled", _broken_impl)
    broken_step = jax.jit(slots.step.__wrapped__, static_argnames=("method", "statics"))
    out, _ = _sample_through_slots(target, drafter, SAMPLINGS[0], prompt, 10_000, depth, seed=6, step_fn=broken_step)
    pvalue = chi_square_pvalue(np.bincount(out[:, 1], minlength=TINY.vocab_size), exact[1])
    assert pvalue < 1e-6, pvalue


def test_row_filters_match_the_static_sampling_filters():
    from specjax.decode.sampling import processed_logits

    logits = jax.random.normal(jax.random.key(0), (4, 3, 50)) * 3
    configs = [SamplingConfig(1.0), SamplingConfig(0.7, top_k=5), SamplingConfig(1.3, top_p=0.8),
               SamplingConfig(0.9, top_k=7, top_p=0.6)]
    row = slots.RowSampling(jnp.asarray([c.temperature for c in configs]), jnp.asarray([c.top_k for c in configs]),
                            jnp.asarray([c.top_p for c in configs]))
    got = np.asarray(slots.row_processed_logits(logits, row))
    for i, config in enumerate(configs):
        want = np.asarray(processed_logits(logits[i], config))
        np.testing.assert_allclose(got[i], want, rtol=1e-6)
    greedy = np.asarray(slots.row_processed_logits(logits, slots.RowSampling.greedy(4)))
    assert ((greedy == 0) == (np.arange(50) == np.asarray(logits).argmax(-1)[..., None])).all()
    assert np.isneginf(greedy[greedy != 0]).all()


def test_cancel_frees_the_slot_and_a_full_queue_refuses(target, monkeypatch):
    scheduler = Scheduler(target, None, _config("ar", max_queue=2), compile_now=False)
    try:
        monkeypatch.setattr(scheduler.admission, "admit", lambda: False)  # hold admission: the queue fills
        first = scheduler.submit(Request((1, 2), max_tokens=24, temperature=0.0))
        waiting = [scheduler.submit(Request((3,), max_tokens=24, temperature=0.0))]
        with pytest.raises(QueueFull, match="max_queue 2"):
            scheduler.submit(Request((3,), max_tokens=24, temperature=0.0))
        monkeypatch.undo()
        for handle in [first] + waiting:
            handle.cancel()
        reasons = {h.result(timeout=60).finish_reason for h in [first] + waiting}
        assert reasons <= {"cancelled", "length", "stop"} and "cancelled" in reasons
        deadline = time.time() + 30
        while scheduler.num_running and time.time() < deadline:
            time.sleep(0.05)
        assert scheduler.num_running == 0 and scheduler.num_waiting == 0
        after = scheduler.submit(Request((1, 2), max_tokens=3, temperature=0.0)).result(timeout=60)
        assert after.finish_reason in ("length", "stop") and after.token_ids
    finally:
        scheduler.shutdown(drain=False)


@pytest.mark.parametrize("bad, message", [
    (Request((), max_tokens=4), "empty"),
    (Request((1, 99), max_tokens=4), "outside the vocabulary"),
    (Request((1,), max_tokens=0), "max_tokens"),
    (Request((1,), max_tokens=25), "max_tokens"),
    (Request((1,) * 50, max_tokens=24), "exceeds the context"),
    (Request((1,), max_tokens=4, temperature=-1.0), "temperature"),
    (Request((1,), max_tokens=4, top_p=0.0), "top_p"),
    (Request((1,), max_tokens=4, stop=("x",)), "tokenizer"),
])
def test_bad_requests_are_refused_with_a_reason(chain_scheduler, bad, message):
    with pytest.raises(SpecjaxError, match=message):
        chain_scheduler.submit(bad)


# ---- the HTTP server ----

def _tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (id i <-> word 'w{i}'), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from specjax.io.tokenizer import TextTokenizer

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY.vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return TextTokenizer(backend, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w1",
                         eos_token_ids=(3,))


def _serve_in_thread(scheduler):
    """uvicorn on 127.0.0.1 (a free port) in a thread, serving a Scheduler or a Startup; returns (url, stop)."""
    import uvicorn

    from specjax.serve.http import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(scheduler), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(timeout=30)
        built = getattr(scheduler, "scheduler", scheduler)  # a Startup's, once built
        if built is not None:
            built.shutdown(drain=False)

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def server(target, drafter):
    model = LoadedModel("tiny", TINY, target.params, _tiny_tokenizer(), target.eos_token_ids)
    scheduler = Scheduler(model, drafter, _config("chain", slot_count=2, max_queue=64))
    url, stop = _serve_in_thread(scheduler)
    yield url, scheduler, model
    stop()


def test_health_answers_while_the_server_starts_and_ready_once_it_serves(target, drafter):
    """Liveness apart from readiness: /health is 200 (ready false) and requests get 503 with
    Retry-After while the scheduler is built; /ready turns 200 once it is; a failed start is a 500."""
    import httpx

    from specjax.serve.http import Startup

    model = LoadedModel("tiny", TINY, target.params, _tiny_tokenizer(), target.eos_token_ids)
    release = threading.Event()

    def build():
        assert release.wait(60)
        return Scheduler(model, drafter, _config("ar", slot_count=1))

    startup = Startup(build, "tiny", 128).start()
    url, stop = _serve_in_thread(startup)
    try:
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "ready": False, "phase": "starting"}
        assert httpx.get(f"{url}/ready").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 5, 2], "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert "starting" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        release.set()
        assert startup.wait(120) is not None
        assert httpx.get(f"{url}/ready").status_code == 200
        done = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 5, 2], "max_tokens": 2, "temperature": 0},
                          timeout=60)
        assert done.status_code == 200 and len(done.json()["choices"][0]["token_ids"]) == 2
    finally:
        stop()

    def broken():
        raise ValueError("no such drafter")

    failed = Startup(broken, "tiny", 128).start()
    failed.wait(30)
    url, stop = _serve_in_thread(failed)
    try:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 500 and health.json()["phase"] == "failed"
        assert "no such drafter" in httpx.post(f"{url}/v1/completions", json={"prompt": [1]}).json()["error"]["message"]
    finally:
        stop()


def _client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_through_the_openai_client_equal_generate(server, drafter):
    url, scheduler, model = server
    client = _client(url)
    expected = Engine(model, drafter).generate([[1, 5, 2]], 12, method="chain").tokens[0]
    response = client.completions.create(model="tiny", prompt=[1, 5, 2], max_tokens=12, temperature=0)
    assert response.choices[0].text == model.tokenizer.decode(expected)
    assert response.usage.completion_tokens == len(expected) and response.usage.prompt_tokens == 3
    extra = response.model_extra
    assert extra["metrics"]["speculative_decoding"]["verify_steps"] >= 1
    assert response.choices[0].model_extra["token_ids"] == expected

    streamed = client.completions.create(model="tiny", prompt=[1, 5, 2], max_tokens=12, temperature=0, stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == response.choices[0].text
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_completions_streamed_and_not(server):
    url, _, model = server
    client = _client(url)
    messages = [{"role": "user", "content": "w5 w2 w7"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    stopped = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                             stop=[text.split()[1]])
    assert stopped.choices[0].finish_reason == "stop"
    assert text.startswith(stopped.choices[0].message.content) and len(stopped.choices[0].message.content) < len(text)


def test_models_health_and_prometheus_metrics(server):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    url, scheduler, _ = server
    scheduler.submit(Request((1, 5, 2), max_tokens=12, temperature=0.0)).result(timeout=60)
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "ready": True, "phase": "ready", "running": 0,
                                                 "waiting": 0}
    assert httpx.get(f"{url}/ready").status_code == 200
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    for name in ("specjax:spec_decode_num_drafts", "specjax:spec_decode_num_accepted_tokens_per_pos",
                 "specjax:time_to_first_token_seconds", "specjax:num_requests_running",
                 "specjax:kv_cache_usage_perc"):
        assert name in families, name
    drafts = [s.value for s in families["specjax:spec_decode_num_drafts"].samples if s.name.endswith("_total")]
    assert drafts and drafts[0] > 0
    # The stall estimate and the step's phase split (measured at start-up, as the server compiles).
    by_label = lambda name, label: {s.labels[label]: s.value for s in families[name].samples}  # noqa: E731
    utilization = by_label("specjax:step_utilization", "resource")
    assert set(utilization) == {"flops", "bytes"} and all(0 < v < 10 for v in utilization.values()), utilization
    phases = by_label("specjax:step_seconds", "phase")
    assert {"prefill", "step", "draft", "verify"} <= set(phases)
    assert phases["draft"] + phases["verify"] == pytest.approx(phases["step"])


def test_the_work_model_counts_every_row_and_the_peaks_are_cached(target, drafter, tmp_path):
    from specjax.decode.roofline import StepShape, measure_peaks, step_work

    ar = StepShape(TINY, 1000, rows=4)
    flops, bytes_read = step_work(ar, 1, 64)
    per_token = 2 * TINY.num_params() + 4 * TINY.num_layers * TINY.num_heads * TINY.head_dim * 64
    assert flops == 4 * per_token
    assert bytes_read == 1000 + 4 * 64 * TINY.kv_bytes_per_token(4)
    assert step_work(StepShape(TINY, 1000, rows=8), 1, 64)[0] == 2 * flops  # idle rows are computed too
    chain = StepShape(TINY, 1000, 4, drafter.config, 500, TINY.vocab_size)
    assert step_work(chain, 4, 64)[0] > 4 * flops and step_work(chain, 4, 64)[1] > bytes_read
    first = measure_peaks(tmp_path, matmul=128, array_mib=4)
    assert first.flops_per_s > 0 and first.bytes_per_s > 0
    assert measure_peaks(tmp_path, matmul=128, array_mib=4) == first  # loaded, not measured again
    low = measure_peaks(tmp_path, matmul=128, array_mib=4, dtype="bfloat16")  # its own entry, measured
    assert low.flops_per_s > 0 and len(json.loads((tmp_path / "peaks.json").read_text())) == 2


@pytest.mark.parametrize("body, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"prompt": [1, 2], "model": "other"}), "unknown model"),
    (json.dumps({"prompt": [1, 2], "max_tokens": "ten"}), "max_tokens"),
    (json.dumps({"prompt": [1, 2], "max_tokens": 10_000}), "max_tokens"),
    (json.dumps({"prompt": [1, 2], "temperature": -0.5}), "temperature"),
    (json.dumps({"prompt": [1, 2], "top_p": 0}), "top_p"),
    (json.dumps({"prompt": ""}), "empty"),
    (json.dumps({"prompt": [1] * 45, "max_tokens": 20}), "exceeds the context"),
    (json.dumps({"prompt": [1, 2], "logprobs": 2}), "'logprobs' is not supported"),
    (json.dumps({"prompt": [1, 2], "n": 0}), "'n' must be in"),
    (json.dumps({"prompt": [1, 2], "n": 2, "stream": True}), "streaming returns one choice"),
    (json.dumps({"prompt": ["w1 w2"] * 9, "n": 2}), "at most 16"),
    (json.dumps({"messages": [{"role": "robot", "content": "w1"}]}), "role must be one of"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
     "only text parts"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}), "must be a string or a list of text parts"),
])
def test_bad_http_requests_get_400_with_a_message(server, body, message):
    import httpx

    url, _, _ = server
    path = "chat/completions" if "messages" in body else "completions"
    response = httpx.post(f"{url}/v1/{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_a_body_past_the_limit_is_refused_before_it_is_read(server):
    import httpx

    from specjax.serve.http import body_limit

    url, scheduler, _ = server
    limit = body_limit(scheduler.config.context_length)
    huge = json.dumps({"prompt": "w1 " * (limit // 3 + 10)})
    response = httpx.post(f"{url}/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and f"{limit:,}" in response.json()["error"]["message"]


def test_text_parts_n_choices_and_batched_prompts_as_the_openai_client_sends_them(server):
    url, _, _ = server
    client = _client(url)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w2\nw7"}],
                                           max_tokens=8, temperature=0)
    parts = client.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "w5 w2"}, {"type": "text", "text": "w7"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    developer = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "developer", "content": "w3"}, {"role": "user", "content": "w5 w2\nw7"}])
    assert developer.choices[0].message.content  # "developer" is OpenAI's newer "system"
    two = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w2"}], max_tokens=8,
                                         temperature=1.0, seed=3, n=2)
    one = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w2"}], max_tokens=8,
                                         temperature=1.0, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == one.choices[0].message.content  # choice j samples with seed + j
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    batch = client.completions.create(model="tiny", prompt=["w1 w2", "w3 w4 w5"], max_tokens=6, temperature=0)
    singles = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
               for p in ("w1 w2", "w3 w4 w5")]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_the_openai_client_gets_the_refusals_as_errors(server):
    """What the server refuses reaches the official client as its own errors: log-probabilities and an
    unknown role as 400 (BadRequestError), a body over the byte limit as 413 before it is read."""
    import openai

    from specjax.serve.http import body_limit

    url, scheduler, _ = server
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="'logprobs' is not supported"):
        client.completions.create(model="tiny", prompt="w1 w2", max_tokens=4, logprobs=2)
    with pytest.raises(openai.BadRequestError, match="role must be one of"):
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "robot", "content": "w1"}])
    limit = body_limit(scheduler.config.context_length)
    with pytest.raises(openai.APIStatusError, match="reads at most") as refused:
        client.completions.create(model="tiny", prompt="w1 " * (limit // 3 + 10), max_tokens=4)
    assert refused.value.status_code == 413


def test_the_body_limit_is_a_setting(target):
    """--max-request-bytes (ServeConfig.max_request_bytes) replaces the limit derived from the context."""
    from fastapi.testclient import TestClient

    from specjax.errors import SpecjaxError
    from specjax.serve.http import create_app

    with pytest.raises(SpecjaxError, match="max_request_bytes"):
        _config("ar", max_request_bytes=0)
    scheduler = Scheduler(target, None, _config("ar", max_request_bytes=200), compile_now=False)
    try:
        response = TestClient(create_app(scheduler)).post("/v1/completions",
                                                          json={"prompt": "w1 " * 100, "max_tokens": 4})
        assert response.status_code == 413 and "reads at most 200" in response.json()["error"]["message"]
    finally:
        scheduler.shutdown(drain=False)


def test_a_full_queue_answers_429_with_retry_after(target, monkeypatch):
    from fastapi.testclient import TestClient

    from specjax.serve.http import create_app

    scheduler = Scheduler(target, None, _config("ar", max_queue=1), compile_now=False)
    try:
        monkeypatch.setattr(scheduler.admission, "admit", lambda: False)  # hold admission so the queue stays full
        queued = scheduler.submit(Request((1, 2), max_tokens=4, temperature=0.0))
        response = TestClient(create_app(scheduler)).post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert "waiting" in response.json()["error"]["message"]
        monkeypatch.undo()
        assert queued.result(timeout=60).finish_reason in ("length", "stop")
    finally:
        scheduler.shutdown(drain=False)


# ---- the load generator and the live view ----

def test_arrivals_follow_the_rate_and_burstiness():
    from specjax.serve.loadgen import LoadSpec, arrival_times

    times = arrival_times(LoadSpec(request_rate=4.0, burstiness=1.0, num_requests=4000, seed=1))
    gaps = np.diff(times)
    assert abs(gaps.mean() - 0.25) < 0.02 and abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential: cv 1
    regular = np.diff(arrival_times(LoadSpec(request_rate=4.0, burstiness=16.0, num_requests=4000, seed=1)))
    assert regular.std() / regular.mean() < 0.35  # gamma shape 16: cv 1/4
    assert (arrival_times(LoadSpec(num_requests=5)) == 0).all()  # infinite rate: all at once


def test_the_load_generator_refuses_remote_hosts_and_bad_slos():
    from specjax.serve.loadgen import LoadSpec, check_loopback, parse_goodput

    check_loopback("http://127.0.0.1:8000")
    with pytest.raises(SpecjaxError, match="loopback"):
        check_loopback("http://example.com:8000")
    assert parse_goodput("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    for bad in ("latency:5", "ttft:fast"):
        with pytest.raises(SpecjaxError):
            parse_goodput(bad)
    with pytest.raises(SpecjaxError):
        LoadSpec(request_rate=0)


def test_bench_serve_against_the_server(server):
    """A bounded burst through the real server: every request completes, and the summary holds the
    fields vllm bench serve users read."""
    from specjax.serve.loadgen import LoadSpec, benchmark

    url, _, _ = server
    summary = benchmark(url, ["w1 w2 w3", "w4 w5"], LoadSpec(request_rate=50.0, num_requests=12, max_tokens=8,
                                                              time_limit_s=120, chat=False),
                        goodput={"ttft": 60_000})
    assert summary["completed"] == 12 and summary["failed"] == 0, summary["first_errors"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    assert summary["ttft_ms"]["p50"] <= summary["e2el_ms"]["p50"]
    assert summary["output_token_throughput"] > 0 and summary["goodput"] > 0
    kv = summary["kv_bytes_in_use"]  # sampled from the server's /metrics during the burst
    assert kv is not None and 0 <= kv["mean"] <= kv["max"]


def test_the_dashboard_reads_the_metrics_it_is_given():
    from rich.console import Console

    from specjax.monitor.serving import ServingMetrics
    from specjax.serve.top import histogram_quantile, parse_metrics, render, summarize

    metrics = ServingMetrics("chain")
    metrics.verify_steps(10, 30, [6, 3, 1])  # 10 drafts, 10 accepted: tau 2.0
    for seconds in (0.1, 0.2, 0.3, 0.4):
        metrics.first_token(seconds)
    metrics.memory(0.25, {"target": 3 * 2**20}, {"target": 4096})
    metrics.queue_depth(running=2, waiting=5)
    metrics.timing("step", 0.5)
    metrics.timing("verify", 0.4)
    metrics.roofline(1e9, 8e9, 1e11, 1e10)  # 1% of peak FLOP/s, 80% of peak bytes/s
    view = summarize(parse_metrics(metrics.prometheus_text()), None)
    assert view["tau_overall"] == pytest.approx(2.0)
    assert view["per_position"] == pytest.approx([0.6, 0.3, 0.1])
    assert view["running"] == 2 and view["waiting"] == 5 and view["kv_usage"] == 0.25
    assert 0.1 <= view["ttft"][0.5] <= 0.3
    assert histogram_quantile([(1.0, 0), (2.0, 10), (float("inf"), 10)], 0.5) == pytest.approx(1.5)
    console = Console(width=120, record=True)
    console.print(render(view, "http://127.0.0.1:1"))
    screen = console.export_text()
    assert "2.00 overall" in screen and "running 2" in screen and "waiting 5" in screen and "chain" in screen
    assert "verify 400 ms" in screen and "80% of peak bytes/s" in screen and "memory-bound" in screen


def test_specjax_top_in_tmux_shows_the_servers_numbers(server, tmp_path):
    """Start `specjax top` in a tmux pane against the live server and read the screen as a person would."""
    import shutil
    import subprocess
    import sys

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    url, scheduler, _ = server
    scheduler.submit(Request((1, 5, 2), max_tokens=12, temperature=0.0)).result(timeout=60)
    session = f"specjax-top-{int(time.time() * 1000)}"
    command = f"{sys.executable} -m specjax.cli top --url {url} --interval 0.5"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command], check=True)
    try:
        screen = ""
        deadline = time.time() + 60
        while time.time() < deadline:
            time.sleep(1.0)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            if "overall" in screen and "TTFT" in screen:
                break
        assert "specjax top" in screen and "method chain" in screen, screen
        assert "overall" in screen and "acceptance per draft position" in screen and "TTFT" in screen, screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


# ---- reliability ----

class _FailingTokenizer:
    """Decodes like the tiny tokenizer until a row has 5 tokens, then raises (a bug in one request)."""

    def __init__(self):
        self.inner = _tiny_tokenizer()

    def decode(self, ids, skip_special_tokens=True):
        if len(ids) >= 5:
            raise RuntimeError("detokenizer exploded")
        return self.inner.decode(ids)


def test_an_exception_in_one_request_fails_that_request_only(target):
    model = LoadedModel("tiny", TINY, target.params, _FailingTokenizer(), target.eos_token_ids)
    scheduler = Scheduler(model, None, _config("ar"), compile_now=False)
    try:
        # Prompt [7] does not reach EOS in its first 10 greedy tokens, so it reaches the failing decode.
        doomed = scheduler.submit(Request((7,), max_tokens=10, temperature=0.0))
        fine = scheduler.submit(Request((1, 5, 2), max_tokens=3, temperature=0.0))
        assert doomed.result(timeout=60).finish_reason == "error"
        assert "detokenizer exploded" in doomed.result().error
        assert fine.result(timeout=60).finish_reason in ("length", "stop") and fine.result().error is None
        assert scheduler.submit(Request((2, 2), max_tokens=3, temperature=0.0)).result(60).error is None
    finally:
        scheduler.shutdown(drain=False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish(tmp_path):
    """`specjax serve` in its own process: SIGTERM while a request streams; the stream still ends
    with its last chunk and [DONE], and the process exits 0."""
    import signal
    import subprocess
    import sys

    import httpx

    from conftest import build_tiny_hf

    build_tiny_hf("llama", seed=4).save_pretrained(tmp_path / "model")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--model", str(tmp_path / "model"),
                               "--method", "ar", "--slots", "2", "--context-length", "256", "--max-new-tokens", "200",
                               "--steps-per-sync", "2", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        lines, signalled = [], False
        body = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                if not signalled and len(lines) == 2:
                    server.send_signal(signal.SIGTERM)
                    signalled = True
        assert signalled and lines[-1] == "[DONE]", lines[-3:]
        final = json.loads(lines[-2])
        assert final["choices"][0]["finish_reason"] in ("stop", "length")
        assert final["usage"]["completion_tokens"] >= 1
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            server.kill()
        output = server.stdout.read()
    assert "serving" in output


@pytest.mark.slow
def test_resident_memory_stays_flat_over_10000_requests(target):
    """10,000 short requests through one scheduler: RSS after the last 9,000 grows by less than 64 MiB."""

    def rss_mib() -> float:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    scheduler = Scheduler(target, None, _config("ar", slot_count=8, max_queue=256), compile_now=False)
    try:
        rng = np.random.default_rng(0)
        readings = []
        for start in range(0, 10_000, 200):
            handles = [scheduler.submit(Request(tuple(rng.integers(0, TINY.vocab_size, 3).tolist()), max_tokens=3,
                                                temperature=float(i % 2), seed=i))
                       for i in range(200)]
            for handle in handles:
                assert handle.result(timeout=120).finish_reason in ("length", "stop")
            if start + 200 in (1_000, 10_000):
                readings.append(rss_mib())
        print(f"RSS after 1,000 requests {readings[0]:.0f} MiB, after 10,000 {readings[1]:.0f} MiB")
        assert readings[1] - readings[0] < 64, readings
    finally:
        scheduler.shutdown(drain=False)


@pytest.mark.slow
def test_smollm2_greedy_requests_through_the_server_equal_generate(smollm2):
    """The real model and its committed drafter, held-out chat prompts sharing 3 slots."""
    from specjax.data.prompts import heldout_prompts
    from specjax.io.registry import resolve_drafter

    drafter = resolve_drafter("default", "smollm2")
    prompts = [smollm2.tokenizer.encode_chat(t) for t in heldout_prompts("chat")[:4]]
    scheduler = Scheduler(smollm2, drafter, ServeConfig(method="chain", slots=3, context_length=256,
                                                        max_new_tokens=32), compile_now=False)
    try:
        handles = [scheduler.submit(Request(tuple(p), max_tokens=32, temperature=0.0)) for p in prompts]
        served = [h.result(timeout=600).token_ids for h in handles]
    finally:
        scheduler.shutdown()
    engine = Engine(smollm2, drafter)
    assert served == [engine.generate([p], 32, method="chain").tokens[0] for p in prompts]


def test_a_client_that_disconnects_cancels_its_request(target, monkeypatch):
    """A client gives up while its request still waits: the server notices and cancels it, so it
    never takes a slot."""
    import httpx

    scheduler = Scheduler(target, None, _config("ar"), compile_now=False)
    url, stop = _serve_in_thread(scheduler)
    try:
        monkeypatch.setattr(scheduler.admission, "admit", lambda: False)  # hold admission: the request waits
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 8, "temperature": 0}, timeout=1.0)
        deadline = time.time() + 20
        while scheduler.num_waiting and time.time() < deadline:
            time.sleep(0.1)
        assert scheduler.num_waiting == 0 and scheduler.num_running == 0
        assert 'finished_reason="cancelled"} 1.0' in scheduler.metrics.prometheus_text()
    finally:
        monkeypatch.undo()
        stop()


def test_attending_to_fewer_slots_changes_nothing_for_rows_that_fit(target):
    """forward(attend_slots=L) reads only the first L cache slots: for rows whose context fits, the
    logits and the written cache are those of the full read."""
    from specjax.models.cache import KVCache
    from specjax.models.transformer import forward

    rng = np.random.default_rng(0)
    cache = KVCache.zeros(TINY, 3, 64)
    prompt = jnp.asarray(rng.integers(0, TINY.vocab_size, (3, 20)), jnp.int32)
    cache = forward(target.params, TINY, prompt, jnp.broadcast_to(jnp.arange(20), (3, 20)), cache,
                    jnp.zeros((3,), jnp.int32)).cache
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (3, 4)), jnp.int32)
    write = jnp.asarray([20, 9, 14], jnp.int32)
    positions = write[:, None] + jnp.arange(4)
    full = forward(target.params, TINY, tokens, positions, cache, write)
    short = forward(target.params, TINY, tokens, positions, cache, write, attend_slots=24)
    assert_rounding_close(short.logits, full.logits)
    for a, b in zip(short.cache.keys, full.cache.keys):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
