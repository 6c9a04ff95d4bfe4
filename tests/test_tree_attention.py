"""The Pallas tree-attention kernel (in interpret mode on CPU) against its jnp reference, and the reference
against the model's own XLA attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.pallas_kernels.tree_attention import (
    AttentionScores,
    BlockSizes,
    tree_attention,
    tree_attention_op,
    tree_attention_reference,
)

F32_TOLERANCE = dict(atol=2e-5, rtol=2e-5)
BF16_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


# ---- masks for the shapes of new-token blocks the decoder produces ----

def chain_mask(num_new: int) -> np.ndarray:
    """A causal chain (plain speculative block or prefill chunk): lower triangular."""
    return np.tril(np.ones((num_new, num_new), bool))


def mask_from_parents(parents: list[int]) -> np.ndarray:
    """Ancestor-or-self mask of a tree given each node's parent (-1 for the root, parent < node)."""
    mask = np.eye(len(parents), dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]  # a node sees what its parent sees, plus itself
    return mask


def star_mask(num_new: int) -> np.ndarray:
    """A root and num_new - 1 sibling children: the widest one-level tree."""
    return mask_from_parents([-1] + [0] * (num_new - 1))


def random_tree_mask(rng: np.random.Generator, num_new: int) -> np.ndarray:
    return mask_from_parents([-1] + [int(rng.integers(0, node)) for node in range(1, num_new)])


def make_inputs(rng, *, batch=2, num_new=8, cache_length=40, num_heads=4, num_kv_heads=2, head_dim=16,
                dtype=jnp.float32, prefix_lengths=None, tree="random"):
    """Random arguments for one call; each batch row gets its own tree when tree="random"."""
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    if tree == "random":
        masks = np.stack([random_tree_mask(rng, num_new) for _ in range(batch)])
    else:
        one = {"chain": chain_mask, "star": star_mask}[tree](num_new)
        masks = np.broadcast_to(one, (batch, num_new, num_new))
    if prefix_lengths is None:
        prefix_lengths = rng.integers(0, cache_length + 1, size=batch)
    return dict(
        # Scores spread over a few units so the softmax is far from uniform and errors show.
        q=jnp.asarray(2.0 * normal(batch, num_new, num_heads, head_dim), dtype),  # [B, T, H, D]
        cache_k=jnp.asarray(normal(batch, cache_length, num_kv_heads, head_dim), dtype),  # [B, S, Kh, D]
        cache_v=jnp.asarray(normal(batch, cache_length, num_kv_heads, head_dim), dtype),  # [B, S, Kh, D]
        prefix_lengths=jnp.asarray(prefix_lengths, jnp.int32),  # [B]
        tree_k=jnp.asarray(normal(batch, num_new, num_kv_heads, head_dim), dtype),  # [B, T, Kh, D]
        tree_v=jnp.asarray(normal(batch, num_new, num_kv_heads, head_dim), dtype),  # [B, T, Kh, D]
        tree_mask=jnp.asarray(masks),  # [B, T, T]
    )


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype == dtype
    assert np.all(np.isfinite(np.asarray(actual, np.float32)))
    tolerance = F32_TOLERANCE if dtype == jnp.float32 else BF16_TOLERANCE
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), **tolerance)


# ---- the reference is the model's attention ----

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_matches_model_attention_over_a_written_cache(dtype):
    """Write the new tokens' K/V into the cache at each row's prefix length and run the model's own
    attention_mask + grouped_query_attention: the reference must give the same numbers."""
    from specjax.models.layers import attention_mask, grouped_query_attention

    rng = np.random.default_rng(0)
    cache_length, num_new = 48, 7
    args = make_inputs(rng, batch=3, num_new=num_new, cache_length=cache_length, num_heads=6, num_kv_heads=2,
                       dtype=dtype, prefix_lengths=[0, 13, cache_length - num_new])
    write = lambda cache, new: jax.vmap(  # noqa: E731
        lambda c, n, start: jax.lax.dynamic_update_slice_in_dim(c, n, start, axis=0))(cache, new, args["prefix_lengths"])
    full_k = write(args["cache_k"], args["tree_k"])  # [B, S, Kh, D]
    full_v = write(args["cache_v"], args["tree_v"])  # [B, S, Kh, D]
    mask = attention_mask(args["prefix_lengths"], num_new, cache_length, args["tree_mask"])  # [B, T, S]
    expected = grouped_query_attention(args["q"], full_k, full_v, mask)
    actual = tree_attention_reference(**args)
    # Same math, only the order of the keys differs, so float32 agrees to rounding.
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == jnp.float32 else BF16_TOLERANCE
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), **tolerance)


# ---- kernel against reference ----

CASES = {
    # name: (make_inputs overrides, BlockSizes); B=2 rows get prefix lengths 0 and exactly S.
    "chain-f32-G2": (dict(num_new=8, cache_length=40, tree="chain", prefix_lengths=[0, 40]), BlockSizes(16, 16)),
    "star-f32-G3": (dict(num_new=7, cache_length=64, num_heads=6, num_kv_heads=2, tree="star",
                         prefix_lengths=[64, 0]), BlockSizes(16, 32)),
    # T=24 and S=72 are multiples of neither block: padding on both axes, a partial last cache block.
    "random-f32-G2-ragged": (dict(batch=3, num_new=24, cache_length=72, prefix_lengths=[0, 37, 72]),
                             BlockSizes(16, 32)),
    "random-f32-G3": (dict(num_new=13, cache_length=96, num_heads=6, num_kv_heads=2, prefix_lengths=[50, 96]),
                      BlockSizes(16, 64)),
    "random-f32-G1": (dict(num_new=5, cache_length=45, num_heads=2, num_kv_heads=2, prefix_lengths=[45, 3]),
                      BlockSizes()),
    "decode-f32-G3": (dict(num_new=1, cache_length=50, num_heads=3, num_kv_heads=1, prefix_lengths=[0, 50]),
                      BlockSizes()),
    "chain-bf16-G2": (dict(num_new=8, cache_length=40, tree="chain", dtype=jnp.bfloat16, prefix_lengths=[40, 0]),
                      BlockSizes(16, 16)),
    "random-bf16-G3": (dict(num_new=20, cache_length=88, num_heads=6, num_kv_heads=2, dtype=jnp.bfloat16,
                            prefix_lengths=[0, 88]), BlockSizes(16, 32)),
    "decode-bf16-G2": (dict(num_new=1, cache_length=64, dtype=jnp.bfloat16, prefix_lengths=[64, 21]), BlockSizes()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    overrides, block_sizes = CASES[name]
    args = make_inputs(np.random.default_rng(list(CASES).index(name)), **overrides)
    expected = tree_attention_reference(**args)
    actual = tree_attention(**args, block_sizes=block_sizes, interpret=True)
    assert actual.shape == args["q"].shape
    assert_close(actual, expected, args["q"].dtype)


def test_soft_capped_rescaled_logits():
    """Gemma 2's logits (scale 1/sqrt(query_pre_attn_scalar), soft cap): kernel against reference, and
    the cap changes the result."""
    args = make_inputs(np.random.default_rng(11))
    args["q"] = 4.0 * args["q"]  # large logits, so the cap bites
    scores = AttentionScores(scale=24**-0.5, softcap=2.0)
    expected = tree_attention_reference(**args, scores=scores)
    assert_close(tree_attention(**args, scores=scores, interpret=True), expected, args["q"].dtype)
    uncapped = tree_attention_reference(**args, scores=AttentionScores(scale=24**-0.5))
    assert np.abs(np.asarray(uncapped) - np.asarray(expected)).max() > 0.1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_garbage_past_the_prefix_is_ignored(dtype):
    """Slots at and after prefix_lengths[b] may hold anything; huge values there must not leak in, not even
    through the partially visible last cache block."""
    rng = np.random.default_rng(1)
    cache_length = 56
    args = make_inputs(rng, batch=2, num_new=6, cache_length=cache_length, dtype=dtype, prefix_lengths=[21, 3])
    past_prefix = (np.arange(cache_length)[None, :] >= np.asarray(args["prefix_lengths"])[:, None])[:, :, None, None]
    garbage = lambda clean: jnp.where(  # noqa: E731
        past_prefix, jnp.asarray(1e30 * rng.standard_normal(clean.shape), dtype), clean)
    dirty = dict(args, cache_k=garbage(args["cache_k"]), cache_v=garbage(args["cache_v"]))
    block_sizes = BlockSizes(16, 16)
    clean_out = tree_attention(**args, block_sizes=block_sizes, interpret=True)
    dirty_out = tree_attention(**dirty, block_sizes=block_sizes, interpret=True)
    np.testing.assert_array_equal(np.asarray(dirty_out, np.float32), np.asarray(clean_out, np.float32))
    np.testing.assert_array_equal(np.asarray(tree_attention_reference(**dirty), np.float32),
                                  np.asarray(tree_attention_reference(**args), np.float32))
    assert_close(dirty_out, tree_attention_reference(**args), dtype)


def test_query_that_sees_nothing_gives_zeros():
    """Empty prefix and an empty tree-mask row: finite zeros from both, never NaN."""
    rng = np.random.default_rng(2)
    args = make_inputs(rng, batch=2, num_new=4, cache_length=40, tree="chain", prefix_lengths=[0, 40])
    args["tree_mask"] = args["tree_mask"].at[:, 2, :].set(False)
    expected = tree_attention_reference(**args)
    actual = tree_attention(**args, block_sizes=BlockSizes(16, 16), interpret=True)
    np.testing.assert_array_equal(np.asarray(expected[0, 2]), 0.0)
    np.testing.assert_array_equal(np.asarray(actual[0, 2]), 0.0)
    assert_close(actual, expected, jnp.float32)


def test_prefix_longer_than_cache_is_clamped():
    rng = np.random.default_rng(3)
    args = make_inputs(rng, batch=2, num_new=3, cache_length=40, prefix_lengths=[40, 40])
    too_long = dict(args, prefix_lengths=jnp.asarray([41, 1000], jnp.int32))
    actual = tree_attention(**too_long, block_sizes=BlockSizes(16, 16), interpret=True)
    assert_close(actual, tree_attention_reference(**args), jnp.float32)


# ---- the dispatcher ----

def test_dispatcher_under_jit_with_traced_prefix_lengths():
    """How the model calls it: inside jit, prefix lengths traced, interpret left to the backend (CPU here)."""
    args = make_inputs(np.random.default_rng(4), num_new=6, cache_length=48)
    run = lambda implementation: jax.jit(  # noqa: E731
        lambda a: tree_attention_op(**a, implementation=implementation))(args)
    assert_close(run("pallas"), run("xla"), jnp.float32)
    np.testing.assert_array_equal(np.asarray(run("xla")), np.asarray(tree_attention_reference(**args)))


def test_dispatcher_rejects_unknown_implementation():
    args = make_inputs(np.random.default_rng(5), num_new=2, cache_length=16)
    with pytest.raises(ValueError, match=r"implementation='triton'.*\('xla', 'pallas'\)"):
        tree_attention_op(**args, implementation="triton")


# ---- argument checks ----

BAD_ARGUMENTS = {
    # case: (argument, replacement shape or None, replacement dtype or None, expected message)
    "q-rank": ("q", (2, 4, 64), None, r"q has shape \(2, 4, 64\), expected 4 dims"),
    "cache_k-batch": ("cache_k", (3, 40, 2, 16), None, r"cache_k has shape \(3, 40, 2, 16\), expected \[B, S, Kh, D\]"),
    "cache_k-heads": ("cache_k", (2, 40, 3, 16), None, r"cache_k has Kh=3 kv heads, which must divide the H=4"),
    "cache_v": ("cache_v", (2, 41, 2, 16), None, r"cache_v has shape \(2, 41, 2, 16\), expected the shape of cache_k"),
    "prefix-shape": ("prefix_lengths", (2, 1), None, r"prefix_lengths has shape \(2, 1\), expected \[B\] = \(2,\)"),
    "prefix-dtype": ("prefix_lengths", None, jnp.float32, r"prefix_lengths has dtype float32"),
    "tree_k": ("tree_k", (2, 5, 2, 16), None,
               r"tree_k has shape \(2, 5, 2, 16\), expected \[B, T, Kh, D\] = \(2, 4, 2, 16\)"),
    "tree_v": ("tree_v", (2, 4, 2, 8), None, r"tree_v has shape \(2, 4, 2, 8\), expected \[B, T, Kh, D\]"),
    "tree_mask-shape": ("tree_mask", (2, 4, 5), None,
                        r"tree_mask has shape \(2, 4, 5\), expected \[B, T, T\] = \(2, 4, 4\)"),
    "tree_mask-dtype": ("tree_mask", None, jnp.int32, r"tree_mask has dtype int32, expected bool"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bad_arguments_are_named(case, implementation):
    """Valid arguments (B=2, T=4, H=4, Kh=2, D=16, S=40) with one replaced by zeros of a wrong shape or dtype."""
    name, shape, dtype, message = BAD_ARGUMENTS[case]
    args = make_inputs(np.random.default_rng(6), batch=2, num_new=4, cache_length=40)
    original = args[name]
    args[name] = jnp.zeros(original.shape if shape is None else shape, original.dtype if dtype is None else dtype)
    with pytest.raises(ValueError, match=message):
        tree_attention_op(**args, implementation=implementation, interpret=True)


@pytest.mark.parametrize("field, value", [("block_q", 24), ("block_k", 8), ("num_warps", 0)])
def test_bad_block_sizes(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}"):
        BlockSizes(**{field: value})


def test_compiled_kernel_needs_a_power_of_two_head_dim():
    """Checked before lowering, so it raises the same way on a machine without a GPU."""
    args = make_inputs(np.random.default_rng(7), num_new=2, cache_length=16, head_dim=24)
    with pytest.raises(ValueError, match="head dim D=24"):
        tree_attention(**args, interpret=False)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_new, cache_length, head_dim", [(37, 300, 64), (1, 1000, 64), (24, 72, 16)])
def test_kernel_lowers_to_triton_for_cuda(num_new, cache_length, head_dim, dtype):
    """Lower (not compile) the kernel for CUDA on this CPU machine. This runs the Pallas-to-Triton
    lowering, which rejects tiles that are not powers of two and primitives Triton lacks; compiling the
    Triton module to PTX still needs a GPU."""
    batch, num_heads, num_kv_heads = 2, 9, 3  # SmolLM2's heads
    spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    args = (spec(batch, num_new, num_heads, head_dim), spec(batch, cache_length, num_kv_heads, head_dim),
            spec(batch, cache_length, num_kv_heads, head_dim), spec(batch, dt=jnp.int32),
            spec(batch, num_new, num_kv_heads, head_dim), spec(batch, num_new, num_kv_heads, head_dim),
            spec(batch, num_new, num_new, dt=jnp.bool_))
    # The small case also lowers Gemma 2's soft cap (tanh inside the key loop).
    scores = AttentionScores(scale=0.1, softcap=50.0) if head_dim == 16 else AttentionScores()
    compiled_kernel = jax.jit(lambda *a: tree_attention(*a, scores=scores, interpret=False))
    lowered = compiled_kernel.trace(*args).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


# ---- the stacked-heads form of the model's attention (many rows, one token, on CPU) ----

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_new,softcap", [(1, None), (1, 5.0), (3, None)])
def test_stacked_heads_attention_equals_the_per_head_form(dtype, num_new, softcap):
    from specjax.models.layers import (grouped_query_attention, per_head_attention, stacked_heads_attention,
                                       stacked_heads_pays)
    from specjax.pallas_kernels.scores import AttentionScores

    rng = np.random.default_rng(num_new)
    batch, slots, heads, kv_heads, dim = 4, 21, 6, 3, 16
    q = jnp.asarray(rng.normal(size=(batch, num_new, heads, dim)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(batch, slots, kv_heads, dim)), dtype) for _ in range(2))
    mask = jnp.asarray(rng.random((batch, num_new, slots)) < 0.6).at[:, :, 0].set(True)
    scores = AttentionScores(softcap=softcap)
    assert not stacked_heads_pays(batch, num_new, kv_heads)  # 4 rows: the per-head form
    expected = grouped_query_attention(q, k, v, mask, scores)
    per_head = per_head_attention(q, k, v, mask, scores)
    np.testing.assert_array_equal(np.asarray(expected, np.float32), np.asarray(per_head, np.float32))
    actual = stacked_heads_attention(q, k, v, mask, scores)
    tolerance = dict(atol=2e-6, rtol=2e-6) if dtype == jnp.float32 else BF16_TOLERANCE
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), **tolerance)
    # A query head reads its own KV head only: changing another head's values leaves it alone.
    v2 = v.at[:, :, 1].add(1.0)
    moved = np.abs(np.asarray(stacked_heads_attention(q, k, v2, mask, scores) - actual, np.float32)).max(axis=(0, 1, 3))
    group = heads // kv_heads
    assert (moved[group : 2 * group] > 0.1).all() and (moved[:group] == 0).all() and (moved[2 * group :] == 0).all()


def test_the_stacked_form_is_chosen_for_many_rows_of_one_token_on_cpu():
    from specjax.models.layers import STACKED_HEADS_MIN_BATCH, stacked_heads_pays

    assert stacked_heads_pays(STACKED_HEADS_MIN_BATCH, 1, 3) == (jax.default_backend() == "cpu")
    assert not stacked_heads_pays(STACKED_HEADS_MIN_BATCH - 1, 1, 3)
    assert not stacked_heads_pays(64, 16, 3)  # a verify block: per head
    assert not stacked_heads_pays(64, 1, 8)  # many KV heads: K-fold products would cost more than the copy


# ---- trees read their ancestors at AR's slots (packed_slots) ----

def test_packed_slots_put_each_querys_ancestors_right_after_the_prefix():
    from specjax.models.layers import attention_mask, packed_slots

    parents = [-1, 0, 0, 2, 1, 3]
    mask = mask_from_parents(parents)
    write_index, slots = 5, 14
    packed = packed_slots(jnp.asarray([write_index]), len(parents), slots, jnp.asarray(mask[None]))
    source, visible = np.asarray(packed.source[0]), np.asarray(packed.visible[0])
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]  # root .. node, the order AR decoding wrote them in
        expected_source = list(range(write_index)) + [write_index + u for u in path]
        assert list(source[node, : len(expected_source)]) == expected_source
        assert visible[node].tolist() == [s < write_index + len(path) for s in range(slots)]
    # A causal block packs to itself: the chain's and AR's layout.
    causal = packed_slots(jnp.asarray([write_index]), 4, slots, jnp.asarray(chain_mask(4)[None]))
    assert (np.asarray(causal.source[0]) == np.arange(slots)).all()
    np.testing.assert_array_equal(np.asarray(causal.visible), np.asarray(attention_mask(jnp.asarray([write_index]), 4, slots, None)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_attention_equals_attention_over_a_reordered_cache(dtype):
    """A query's packed attention is plain attention over a cache holding its ancestors at AR's slots."""
    from specjax.models.layers import packed_attention, packed_slots, per_head_attention

    rng = np.random.default_rng(3)
    parents, write_index, slots = [-1, 0, 1, 0, 3], 7, 16
    mask = jnp.asarray(mask_from_parents(parents)[None])
    q = jnp.asarray(rng.normal(size=(1, len(parents), 6, 16)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(1, slots, 3, 16)), dtype) for _ in range(2))
    packed = packed_slots(jnp.asarray([write_index]), len(parents), slots, mask)
    out = packed_attention(q, k, v, packed)
    for node in range(len(parents)):
        order = np.asarray(packed.source[0, node])
        alone = per_head_attention(q[:, node : node + 1], k[:, order], v[:, order], packed.visible[:, node : node + 1])
        np.testing.assert_allclose(np.asarray(out[:, node], np.float32), np.asarray(alone[:, 0], np.float32),
                                   atol=1e-6 if dtype == jnp.float32 else 1e-2)
