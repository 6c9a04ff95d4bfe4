"""Compute precision apart from storage: bf16 inputs into every dot, float32 accumulation, and
speculative output exact against AR at the same precision."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode.engine import Engine
from specjax.decode.tree import TreeConfig
from specjax.errors import SpecjaxError
from specjax.io.registry import PADDED_QUERY_ROWS, LoadedModel, at_compute_dtype
from specjax.models.cache import KVCache, read_cache
from specjax.models.layers import MIN_DOT_ROWS, accumulate_in_float32
from specjax.models.transformer import embed_tokens, forward, token_embedder

PROMPTS = [[1, 5, 2], [7], [4, 4, 9, 10, 11, 0, 2]]
from conftest import SPEC_BLOCK as BLOCK  # noqa: E402


def test_float32_accumulation_of_bf16_inputs():
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(3, 5, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(64, 40)), jnp.bfloat16)
    numbers = (((2,), (0,)), ((), ()))
    out = accumulate_in_float32(lhs, rhs, numbers)
    assert out.dtype == jnp.float32 and out.shape == (3, 5, 40)
    exact = np.asarray(lhs, np.float64) @ np.asarray(rhs, np.float64)
    np.testing.assert_allclose(np.asarray(out), exact, rtol=1e-5, atol=1e-4)  # bf16 output would be ~1e-2 off


@pytest.mark.parametrize("shape", [(64,), (1, 64), (1, 1, 64), (2, 64), (1, 3, 64)])
def test_few_rows_are_padded_without_changing_them(shape):
    """Dots of fewer than MIN_DOT_ROWS rows run padded to that many; the pad must not leak into the
    rows kept, which equal the same rows computed among real neighbours."""
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(64, 33)), jnp.bfloat16)
    out = accumulate_in_float32(lhs, rhs, (((len(shape) - 1,), (0,)), ((), ())))
    assert out.shape == shape[:-1] + (33,)
    count = int(np.prod(shape[:-1]))
    neighbours = jnp.asarray(rng.normal(size=(MIN_DOT_ROWS, 64)), jnp.bfloat16)
    with_real_rows = jnp.concatenate([lhs.reshape(count, 64), neighbours])  # [count + 4, 64]
    expected = jax.lax.dot_general(with_real_rows, rhs, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)[:count]
    np.testing.assert_array_equal(np.asarray(out).reshape(count, 33), np.asarray(expected))


def test_bf16_forward_keeps_float32_logits_and_halves_the_cache(target):
    bf16 = at_compute_dtype(target, "bfloat16")
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(bf16.params))
    tokens = jnp.asarray([[1, 5, 2, 7]], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    outputs = {}
    for model in (target, bf16):
        cache = KVCache.zeros(model.config, 1, 16)
        outputs[model.config.dtype] = forward(model.params, model.config, tokens, positions, cache,
                                              jnp.zeros((1,), jnp.int32))
    low, high = outputs["bfloat16"], outputs["float32"]
    assert low.logits.dtype == jnp.float32
    assert low.cache.keys[0].nbytes * 2 == high.cache.keys[0].nbytes
    # Stored as bf16 bits, read back as bf16: the cache holds the keys the bf16 forward computed.
    assert read_cache(low.cache.keys[0], jnp.bfloat16).dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(read_cache(low.cache.keys[0], jnp.float32))[0, :4],
                               np.asarray(high.cache.keys[0])[0, :4], rtol=0.05, atol=0.05)
    difference = float(jnp.max(jnp.abs(low.logits - high.logits)))
    assert 0 < difference < 0.1 * float(jnp.max(jnp.abs(high.logits)))  # the same model, at another precision


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_loop_embedder_gives_the_models_own_embeddings(target, dtype, scaled):
    """token_embedder (the refiners' embeddings, taken inside the decode loop's branches) must give
    exactly what the model's own embedding gives, Gemma's sqrt(d) scaling included."""
    model = at_compute_dtype(target, dtype)
    config = dataclasses.replace(model.config, scale_embeddings=scaled)
    ids = jnp.asarray([[0, 5, 2], [model.config.vocab_size - 1, 7, 7]], jnp.int32)
    expected = embed_tokens(model.params, config, ids)
    got = jax.jit(lambda p, i: token_embedder(p, config)(i))(model.params, ids)
    assert got.dtype == expected.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


def test_unknown_compute_dtype_is_refused(target):
    with pytest.raises(SpecjaxError, match="float16"):
        at_compute_dtype(target, "float16")


@pytest.mark.slow  # suite time budget; the padded-steps bf16 test below stays in the default suite
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_greedy_speculation_equals_autoregressive_in_bf16(target, drafter, method):
    engine = Engine(at_compute_dtype(target, "bfloat16"), at_compute_dtype(drafter, "bfloat16"), latency_cache=False)
    options = {"tree": TreeConfig(budget=6)} if method == "tree" else {}  # a fixed size: no latency measuring
    ar = engine.generate(PROMPTS, 30, ignore_eos=True)
    speculative = engine.generate(PROMPTS, 30, ignore_eos=True, method=method, **options)
    assert speculative.tokens == ar.tokens
    assert speculative.stats["tau"] > 1.2, "the bf16 drafter must still be accepted"
    # Batch 1 runs single-row steps through the padded path.
    assert engine.generate(PROMPTS[:1], 30, ignore_eos=True, method=method, **options).tokens == ar.tokens[:1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_decode_steps_are_bitwise_the_verify_pass(target, dtype):
    """With query_rows = W, a one-token step runs W query rows, the shapes of a W-token verify pass,
    and its logits are bitwise the verify pass's row for that token: that is what makes speculative
    output exact by construction rather than up to an ulp."""
    import dataclasses

    model = at_compute_dtype(target, dtype)
    width = 8
    padded = dataclasses.replace(model.config, query_rows=width)
    prompt, extra = PROMPTS[2], [3, 8, 1, 6, 2, 9, 5, 7]
    run = jax.jit(lambda cfg, c, t, at: forward(model.params, cfg, t, at[:, None] + jnp.arange(t.shape[1]), c, at),
                  static_argnums=0)
    cache = run(padded, KVCache.zeros(padded, 1, 64), jnp.asarray([prompt]), jnp.asarray([0])).cache
    whole = run(padded, cache, jnp.asarray([extra]), jnp.asarray([len(prompt)]))
    for i, token in enumerate(extra):
        one = run(padded, cache, jnp.asarray([[token]]), jnp.asarray([len(prompt) + i]))
        assert one.logits.shape == (1, 1, model.config.vocab_size)
        np.testing.assert_array_equal(np.asarray(one.logits[0, 0]), np.asarray(whole.logits[0, i]))
        cache = one.cache
    # A tree-shaped pass (token 3, then siblings 8 and 1 at the same position, then 4 under 1) with its
    # visible tokens packed (what verify_tree runs): each row is bitwise the causal pass along its path.
    tree_mask = jnp.asarray([[[True, False, False, False], [True, True, False, False], [True, False, True, False],
                              [True, False, True, True]]])
    at = jnp.asarray([len(prompt)])
    tree = jax.jit(lambda c, t, m: forward(model.params, padded, t, at[:, None] + jnp.asarray([[0, 1, 1, 2]]), c, at,
                                           block_mask=m, pack_visible=True))(cache, jnp.asarray([[3, 8, 1, 4]]),
                                                                             tree_mask)
    for row, path in ((1, [3, 8]), (2, [3, 1]), (3, [3, 1, 4])):
        along = run(padded, cache, jnp.asarray([path]), at)
        np.testing.assert_array_equal(np.asarray(tree.logits[0, row]), np.asarray(along.logits[0, len(path) - 1]))
    assert tree.logits.shape == (1, 4, model.config.vocab_size)


@pytest.mark.parametrize("method", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_greedy_speculation_equals_autoregressive_with_padded_steps(target, drafter, method):
    """AR and speculation with the same query_rows: greedy outputs agree for batches, ragged prompts
    and a single row, in bf16."""
    import dataclasses

    bf16 = at_compute_dtype(target, "bfloat16")
    padded = dataclasses.replace(bf16, config=dataclasses.replace(bf16.config, query_rows=BLOCK))
    engine = Engine(padded, at_compute_dtype(drafter, "bfloat16"), latency_cache=False)
    ar = engine.generate(PROMPTS, 24, ignore_eos=True)
    batch = engine.generate(PROMPTS, 24, ignore_eos=True, method=method)  # an auto tree: BLOCK nodes every step
    assert batch.tokens == ar.tokens
    if method == "tree":
        assert set(batch.stats["tree_bucket_counts"]) == {BLOCK}
    assert engine.generate(PROMPTS[1:2], 24, ignore_eos=True, method=method).tokens == ar.tokens[1:2]


def test_padded_query_rows_give_auto_trees_their_largest_bucket_within_them(target, drafter, tmp_path):
    """With query_rows = W every bucket up to W runs the same W-row forward: an auto tree verifies
    the largest such bucket every step, and a fixed tree larger than W is refused. A server
    compiles the same buckets as generate."""
    import dataclasses

    from specjax.serve.scheduler import Scheduler, ServeConfig

    padded = dataclasses.replace(target, config=dataclasses.replace(target.config, query_rows=BLOCK))
    engine = Engine(padded, drafter, latency_cache=False)
    assert engine._trees_within_query_rows(TreeConfig()).buckets == (BLOCK,)
    assert engine._trees_within_query_rows(TreeConfig(buckets=(1, 2, BLOCK + 1))).buckets == (2,)
    assert engine._trees_within_query_rows(TreeConfig(budget=BLOCK)) == TreeConfig(budget=BLOCK)
    with pytest.raises(SpecjaxError, match="query_rows"):
        engine._trees_within_query_rows(TreeConfig(budget=BLOCK + 1))
    plain = Engine(target, drafter, latency_cache=False)
    assert plain._trees_within_query_rows(TreeConfig()) == TreeConfig()
    server = Scheduler(padded, drafter, ServeConfig(method="tree", slots=2, context_length=256, max_new_tokens=8,
                                                    prompt_bucket=16), compile_now=False, latency_cache=tmp_path)
    try:
        assert server.statics.tree_buckets == (BLOCK,)
    finally:
        server.shutdown()


def test_auto_precision_is_bf16_only_on_cpus_with_bf16_dot_instructions(monkeypatch):
    """--dtype auto: bf16 on a CPU whose flags name AVX512_BF16 or AMX-BF16, float32 on one without
    (an AVX2 core) and, for now, on GPU and TPU; an unreadable /proc/cpuinfo counts as without."""
    from specjax.io import registry

    xeon = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    epyc = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: avx512_bf16_lookalike\n"
    assert registry.native_bf16_cpu(xeon)
    assert not registry.native_bf16_cpu(epyc)  # only the flags line counts
    assert not registry.native_bf16_cpu("")
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(registry, "native_bf16_cpu", lambda native=native: native)
        assert registry.auto_compute_dtype("cpu") == expected
        assert registry.auto_compute_dtype("gpu") == "float32"
    assert registry.compute_dtype("float32") == "float32"


def test_block_methods_verify_within_the_query_rows():
    """A target padded to W rows verifies at most W: a block larger than W gives a chain its first
    W - 1 drafts; a draft limit that needs more rows is refused; trees and AR keep their names."""
    from specjax.decode.slots import method_within_query_rows

    assert method_within_query_rows("chain", 16, None) == "chain"
    assert method_within_query_rows("chain", 16, 16) == "chain"
    assert method_within_query_rows("chain", 16, 8) == "chain:7"
    assert method_within_query_rows("chain+refiner", 16, 8) == "chain+refiner:7"
    assert method_within_query_rows("rapid+block", 16, 4) == "rapid+block:3"
    assert method_within_query_rows("chain:3", 16, 8) == "chain:3"
    assert method_within_query_rows("chain:7", 8, None) == "chain:7"
    with pytest.raises(SpecjaxError, match="block holds 7"):  # longer than the block, padded or not
        method_within_query_rows("chain:20", 8, None)
    for name in ("tree", "ar", "rapid"):
        assert method_within_query_rows(name, 16, 8) == name
    with pytest.raises(SpecjaxError, match="query_rows"):
        method_within_query_rows("chain:9", 16, 8)
    with pytest.raises(SpecjaxError, match="unknown method"):
        method_within_query_rows("chain:x", 16, 8)
    from specjax.decode.rapid import RapidConfig  # rapid's own drafts are fitted the same way

    assert RapidConfig(drafts=10).within_query_rows(8) == RapidConfig(drafts=7)
    assert RapidConfig(drafts=4, eta=0.5).within_query_rows(8) == RapidConfig(drafts=4, eta=0.5)
    assert RapidConfig(drafts=10).within_query_rows(None) == RapidConfig(drafts=10)


def test_a_target_padded_below_the_block_verifies_its_rows_and_stays_exact(target, drafter, tmp_path):
    """query_rows W smaller than the drafter's block: a chain verifies W - 1 drafts a step (reported as
    chain:K), its greedy output is AR's at the same W for a batch and a single row, an explicit longer
    chain and multi-pass drafting (which verifies the whole block) are refused, and a server runs the
    same fitted chain, for a request naming "chain" too."""
    import dataclasses

    from specjax.serve.controller import ControllerConfig
    from specjax.serve.scheduler import Request, Scheduler, ServeConfig

    width = BLOCK - 2
    bf16 = at_compute_dtype(target, "bfloat16")
    padded = dataclasses.replace(bf16, config=dataclasses.replace(bf16.config, query_rows=width))
    engine = Engine(padded, at_compute_dtype(drafter, "bfloat16"), latency_cache=False)
    ar = engine.generate(PROMPTS, 24, ignore_eos=True)
    chain = engine.generate(PROMPTS, 24, ignore_eos=True, method="chain")
    assert chain.tokens == ar.tokens
    assert chain.stats["method"] == f"chain:{width - 1}"
    assert not any(chain.stats["accepted_length_histogram"][width:])  # never more than W - 1 drafts accepted
    assert engine.generate(PROMPTS[1:2], 24, ignore_eos=True, method="chain").tokens == ar.tokens[1:2]
    with pytest.raises(SpecjaxError, match="query_rows"):
        engine.generate(PROMPTS, 8, method=f"chain:{width}")
    server = Scheduler(padded, at_compute_dtype(drafter, "bfloat16"),
                       ServeConfig(method="chain", slots=2, context_length=256, max_new_tokens=8, prompt_bucket=16),
                       compile_now=False, latency_cache=tmp_path)
    try:
        assert server.policies == (f"chain:{width - 1}",)
        assert server.rules.row_limit(Request(prompt=(1, 2), max_tokens=4, method="chain")) == width - 1
    finally:
        server.shutdown()
    # An adaptive server's default set: under padded rows a shorter chain costs the longest one's
    # step and accepts no more, so ar, the longest chain and the tree within the rows are compiled.
    assert ControllerConfig().policy_set(16) == ("ar", "chain:3", "chain:7", "chain")
    assert ControllerConfig().policy_set(16, query_rows=8) == ("ar", "chain", "tree")
    assert ControllerConfig(policies=("ar", "chain:3")).policy_set(16, query_rows=8) == ("ar", "chain:3")
    server = Scheduler(padded, at_compute_dtype(drafter, "bfloat16"),
                       ServeConfig(method="adaptive", slots=2, context_length=256, max_new_tokens=8, prompt_bucket=16,
                                   controller=ControllerConfig(remember=False)),
                       compile_now=False, latency_cache=tmp_path)
    try:
        assert server.policies == ("ar", f"chain:{width - 1}", "tree")
        assert server.statics.tree_buckets == (width,)  # one tree of as many nodes as padded rows
    finally:
        server.shutdown()


@pytest.mark.slow
def test_greedy_chain_stops_at_eos_in_bf16(target, drafter):
    bf16 = at_compute_dtype(target, "bfloat16")
    free = Engine(bf16).generate([PROMPTS[2]], 30, ignore_eos=True).tokens[0]
    with_eos = LoadedModel("tiny", bf16.config, bf16.params, None, (free[9],))
    engine = Engine(with_eos, at_compute_dtype(drafter, "bfloat16"))
    assert engine.generate([PROMPTS[2]], 30, method="chain").tokens == engine.generate([PROMPTS[2]], 30).tokens
    assert len(engine.generate([PROMPTS[2]], 30).tokens[0]) <= 10


@pytest.mark.slow  # 22 s; bf16 exactness is tested through Engine in this file
def test_dtype_flag_sets_the_compute_precision(tiny_folder_with_drafter, capsys):
    """--dtype on generate: the KV bytes halve in bf16, and chain stays identical to AR at that precision."""
    from specjax.cli import main

    model, drafter = tiny_folder_with_drafter
    base = ["generate", "--model", str(model), "--prompt-ids", "1,5,2", "--max-new-tokens", "12", "--ignore-eos",
            "--json"]
    runs = {}
    for dtype, method in (("float32", "ar"), ("bfloat16", "ar"), ("bfloat16", "chain")):
        extra = ["--drafter", str(drafter)] if method == "chain" else []
        assert main(base + ["--dtype", dtype, "--method", method] + extra) == 0
        runs[dtype, method] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kv = {d: runs[d, "ar"]["stats"]["memory"]["target_kv_bytes"] for d in ("float32", "bfloat16")}
    assert kv["bfloat16"] * 2 == kv["float32"]
    assert main(base + ["--dtype", "float32", "--kv-dtype", "bfloat16"]) == 0
    small_cache = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["memory"]
    assert small_cache["target_kv_bytes"] == kv["bfloat16"]
    assert runs["bfloat16", "chain"]["tokens"] == runs["bfloat16", "ar"]["tokens"]
    # --query-rows auto pads bf16 steps (and not float32 ones); 0 turns it off; nonsense is refused.
    assert runs["bfloat16", "chain"]["stats"]["precision"] == {"dtype": "bfloat16", "kv_dtype": "bfloat16",
                                                               "query_rows": PADDED_QUERY_ROWS}
    assert runs["float32", "ar"]["stats"]["precision"]["query_rows"] is None
    assert main(base + ["--dtype", "bfloat16", "--query-rows", "0"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["precision"]["query_rows"] is None
    assert main(base[:-1] + ["--dtype", "bfloat16"]) == 0  # the readable summary names the precision
    assert f"precision: bfloat16 compute, bfloat16 KV cache, every forward padded to {PADDED_QUERY_ROWS} query rows" in \
        capsys.readouterr().err
    assert main(base + ["--query-rows", "many"]) == 2
    assert "--query-rows takes auto or a number" in capsys.readouterr().err


@pytest.mark.slow  # suite time budget; test_bf16_forward_keeps_float32_logits_and_halves_the_cache stays
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_a_bf16_kv_cache_under_float32_compute_stays_exact(target, drafter, method):
    """The KV cache stored in bf16 while everything computes in float32: half the cache, and greedy
    speculative output still identical to AR with the same cache, at batch 3 and batch 1."""
    from specjax.io.registry import with_kv_dtype

    small_cache = with_kv_dtype(target, "bfloat16")
    assert small_cache.config.dtype == "float32" and small_cache.config.cache_dtype == "bfloat16"
    assert with_kv_dtype(target, "auto").config.cache_dtype == "float32"
    cache = KVCache.zeros(small_cache.config, 1, 16)
    assert cache.keys[0].dtype == jnp.uint16 and read_cache(cache.keys[0], jnp.float32).dtype == jnp.float32  # bf16 bits
    engine = Engine(small_cache, drafter, latency_cache=False)
    options = {"tree": TreeConfig(budget=6)} if method == "tree" else {}
    ar = engine.generate(PROMPTS, 30, ignore_eos=True)
    speculative = engine.generate(PROMPTS, 30, ignore_eos=True, method=method, **options)
    assert speculative.tokens == ar.tokens and speculative.stats["tau"] > 1.2
    assert engine.generate(PROMPTS[:1], 30, ignore_eos=True, method=method, **options).tokens == ar.tokens[:1]
    assert ar.stats["memory"]["target_kv_bytes"] * 2 == \
        Engine(target, drafter, latency_cache=False).generate(PROMPTS, 30).stats["memory"]["target_kv_bytes"]
    # Rounding K/V is a real change of the model, not a no-op: its logits move.
    tokens, positions = jnp.asarray([[1, 5, 2, 7]]), jnp.arange(4, dtype=jnp.int32)[None]
    logits = [forward(m.params, m.config, tokens, positions, KVCache.zeros(m.config, 1, 8), jnp.zeros((1,), jnp.int32))
              .logits for m in (target, small_cache)]
    assert float(jnp.max(jnp.abs(logits[0] - logits[1]))) > 0
    with pytest.raises(SpecjaxError, match="KV-cache dtype"):
        with_kv_dtype(target, "float16")


@pytest.fixture(scope="module")
def tiny_folder_with_drafter(target, drafter, tmp_path_factory):
    from specjax.io.dflash import save_drafter
    from specjax.io.hf import save_hf_model

    root = tmp_path_factory.mktemp("precision_cli")
    save_hf_model(root / "model", target.config, target.params)
    save_drafter(root / "drafter", drafter.config, drafter.params, target.config)
    return root / "model", root / "drafter"
