"""The Pallas windowed-attention kernels (interpret mode on CPU) against their jnp reference: forward,
log-sum-exp and gradients; plus the reference against a dense softmax and merge_attention."""

from __future__ import annotations

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.pallas_kernels.tree_attention import MASK_VALUE
from specjax.pallas_kernels.window_attention import (
    AttentionScores,
    BlockSizes,
    merge_attention,
    sliding_window_ranges,
    window_attention,
    window_attention_op,
    window_attention_reference,
)

TOLERANCE = {jnp.float32: dict(atol=3e-5, rtol=3e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
SMALL_BLOCKS = BlockSizes(block_q=16, block_k=16)  # many blocks on small shapes, so skipping is exercised


def make_qkv(rng, *, batch=2, num_queries=40, num_keys=70, num_heads=4, num_kv_heads=2, head_dim=16,
             dtype=jnp.float32):
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)  # noqa: E731
    # Queries scaled so the softmax is far from uniform and errors show.
    return (2.0 * normal(batch, num_queries, num_heads, head_dim), normal(batch, num_keys, num_kv_heads, head_dim),
            normal(batch, num_keys, num_kv_heads, head_dim))


def dense_attention(q, k, v, visible, scale=None, softcap=None):
    """Textbook softmax attention in float64 numpy over an explicit [B, T, S] mask (GQA by repetition),
    logits scaled by `scale` (default 1/sqrt(D)) and optionally soft-capped."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) * (scale or 1 / np.sqrt(q.shape[-1]))
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(visible[:, None], scores, -np.inf)
    row_max = np.max(scores, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - row_max)
    total = weights.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", weights / np.where(total > 0, total, 1.0), v)
    lse = np.where(total[..., 0] > 0, (row_max + np.log(np.where(total > 0, total, 1.0)))[..., 0], MASK_VALUE)
    return out, np.transpose(lse, (0, 2, 1))


def ranges_to_mask(starts, ends, num_keys):
    keys = np.arange(num_keys)
    return (keys >= np.asarray(starts)[..., None]) & (keys < np.asarray(ends)[..., None])


CASES = {
    # name: (num_queries, num_keys, window, query offset per row, kv lengths or None)
    "window smaller than the sequence": (40, 40, 8, (0, 0), None),
    "window larger than the sequence": (40, 40, 100, (0, 0), None),
    "plain causal": (33, 33, None, (0, 0), None),
    "ragged lengths": (40, 70, 24, (20, 5), (55, 30)),
    "decode-like: few queries at the end of a long cache": (3, 130, 32, (100, 127), (103, 130)),
    "window of one key": (20, 20, 1, (0, 0), None),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_reference_and_dense_softmax(name, dtype):
    num_queries, num_keys, window, offsets, lengths = CASES[name]
    q, k, v = make_qkv(np.random.default_rng(0), num_queries=num_queries, num_keys=num_keys, dtype=dtype)
    positions = jnp.asarray(np.stack([np.arange(num_queries) + o for o in offsets]), jnp.int32)
    starts, ends = sliding_window_ranges(positions, window, None if lengths is None else jnp.asarray(lengths))
    out_ref, lse_ref = window_attention_reference(q, k, v, starts, ends)
    out, lse = window_attention(q, k, v, starts, ends, block_sizes=SMALL_BLOCKS)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), **TOLERANCE[dtype])
    np.testing.assert_allclose(lse, lse_ref, **TOLERANCE[dtype])
    if dtype == jnp.float32:
        dense_out, dense_lse = dense_attention(q, k, v, ranges_to_mask(starts, ends, num_keys))
        np.testing.assert_allclose(out_ref, dense_out, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse_ref, dense_lse, atol=2e-5, rtol=2e-5)


def test_empty_ranges_give_zeros_and_mask_value():
    q, k, v = make_qkv(np.random.default_rng(1), num_queries=20, num_keys=50)
    starts = jnp.asarray(np.tile(np.arange(20) * 2, (2, 1)), jnp.int32)
    ends = starts + 5
    ends = ends.at[0, 3].set(0).at[1, :].set(starts[1])  # one empty query in row 0, all of row 1
    for implementation in ("xla", "pallas"):
        out, lse = window_attention_op(q, k, v, starts, ends, implementation=implementation)
        assert np.all(np.asarray(out[0, 3]) == 0) and np.all(np.asarray(out[1]) == 0)
        assert np.all(np.asarray(lse[0, 3]) == MASK_VALUE) and np.all(np.asarray(lse[1]) == MASK_VALUE)
        assert np.all(np.isfinite(np.asarray(out)))


def test_keys_outside_every_range_are_never_read():
    """NaN and inf in keys nobody may see (a cache's unwritten tail) must not leak into the result."""
    q, k, v = make_qkv(np.random.default_rng(2), num_queries=16, num_keys=64)
    starts, ends = sliding_window_ranges(jnp.tile(jnp.arange(16, dtype=jnp.int32) + 10, (2, 1)), 8)
    k_bad = k.at[:, 40:].set(jnp.nan).at[:, :2].set(jnp.inf)
    v_bad = v.at[:, 40:].set(jnp.nan)
    out, lse = window_attention(q, k_bad, v_bad, starts, ends, block_sizes=SMALL_BLOCKS)
    out_ref, _ = window_attention_reference(q, k, v, starts, ends)
    np.testing.assert_allclose(out, out_ref, **TOLERANCE[jnp.float32])


def test_anchor_ranges_of_drafter_training():
    """Blocks of 4 queries that all see the W context keys before their anchor, as drafter blocks do."""
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, num_queries=24, num_keys=90, num_kv_heads=1)
    anchors = np.sort(rng.integers(0, 90, size=(2, 6)), axis=1)
    starts = jnp.asarray(np.repeat(np.maximum(anchors - 16, 0), 4, axis=1), jnp.int32)
    ends = jnp.asarray(np.repeat(anchors, 4, axis=1), jnp.int32)
    out, lse = window_attention(q, k, v, starts, ends, block_sizes=SMALL_BLOCKS)
    dense_out, dense_lse = dense_attention(q, k, v, ranges_to_mask(starts, ends, 90))
    np.testing.assert_allclose(out, dense_out, atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(lse, dense_lse, atol=3e-5, rtol=3e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["window smaller than the sequence", "ragged lengths", "plain causal"])
def test_gradients_match_reference(name, dtype):
    num_queries, num_keys, window, offsets, lengths = CASES[name]
    q, k, v = make_qkv(np.random.default_rng(4), num_queries=num_queries, num_keys=num_keys, dtype=dtype)
    positions = jnp.asarray(np.stack([np.arange(num_queries) + o for o in offsets]), jnp.int32)
    starts, ends = sliding_window_ranges(positions, window, None if lengths is None else jnp.asarray(lengths))
    probe_out = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.float32)
    probe_lse = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape[:3]), jnp.float32)

    def loss(attention):
        def f(q, k, v):
            out, lse = attention(q, k, v, starts, ends)
            seen = lse > MASK_VALUE / 2  # the log-sum-exp of an empty row is a constant
            return jnp.sum(out.astype(jnp.float32) * probe_out) + jnp.sum(jnp.where(seen, lse, 0.0) * probe_lse)
        return f

    kernel = lambda *a: window_attention(*a, block_sizes=SMALL_BLOCKS)  # noqa: E731
    expected = jax.grad(loss(window_attention_reference), argnums=(0, 1, 2))(q, k, v)
    actual = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    for name_, a, e in zip("qkv", actual, expected):
        assert a.dtype == e.dtype == dtype, name_
        scale = float(np.max(np.abs(np.asarray(e, np.float32))))
        tol = 3e-5 if dtype == jnp.float32 else 4e-2
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), atol=tol * scale, rtol=tol,
                                   err_msg=f"d{name_}")


def test_gradients_against_finite_differences():
    """The reference's own gradient is checked numerically, so the kernel is not just matched to a bug."""
    q, k, v = make_qkv(np.random.default_rng(7), batch=1, num_queries=6, num_keys=9, num_heads=2, num_kv_heads=1,
                       head_dim=4)
    starts, ends = sliding_window_ranges(jnp.arange(6, dtype=jnp.int32)[None] + 3, 4)
    with jax.enable_x64():
        args = tuple(x.astype(jnp.float64) for x in (q, k, v))
        f = lambda *a: jnp.sum(jnp.sin(window_attention_reference(*a, starts, ends)[0])) + jnp.sum(  # noqa: E731
            window_attention_reference(*a, starts, ends)[1] ** 2)
        jax.test_util.check_grads(f, args, order=1, modes=("rev",), atol=1e-4, rtol=1e-4)


def test_soft_capped_rescaled_logits():
    """Gemma 2's logits (q.k scaled by 1/sqrt(query_pre_attn_scalar), then soft-capped): the kernels'
    forward and lse against float64, their gradients (through the cap's derivative) against the
    reference's autodiff."""
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng)
    q = 3.0 * q  # large logits, so the cap bites
    starts, ends = sliding_window_ranges(jnp.broadcast_to(jnp.arange(40), (2, 40)), 12)
    scores = AttentionScores(scale=24**-0.5, softcap=2.5)
    out, lse = window_attention(q, k, v, starts, ends, block_sizes=SMALL_BLOCKS, scores=scores)
    want_out, want_lse = dense_attention(q, k, v, ranges_to_mask(starts, ends, 70), 24**-0.5, 2.5)
    np.testing.assert_allclose(out, want_out, **TOLERANCE[jnp.float32])
    np.testing.assert_allclose(lse, want_lse, **TOLERANCE[jnp.float32])
    uncapped, _ = dense_attention(q, k, v, ranges_to_mask(starts, ends, 70), 24**-0.5)
    assert np.abs(uncapped - want_out).max() > 0.1  # the cap changed the result

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v)[0] ** 2) + jnp.sum(jnp.sin(fn(q, k, v)[1]))

    kernel = lambda q, k, v: window_attention(q, k, v, starts, ends, block_sizes=SMALL_BLOCKS, scores=scores)
    reference = lambda q, k, v: window_attention_reference(q, k, v, starts, ends, scores)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_merge_attention_equals_attention_over_the_union():
    """A window, a block's own keys and summary tokens attended separately and merged equal one
    softmax over all of them: how the windowed drafter combines its three key sets."""
    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, num_queries=8, num_keys=60)
    starts = jnp.full((2, 8), 20, jnp.int32)
    ends = jnp.full((2, 8), 44, jnp.int32)
    window = window_attention(q, k, v, starts, ends, block_sizes=SMALL_BLOCKS)
    own = window_attention_reference(q, k, v, jnp.full((2, 8), 50, jnp.int32), jnp.full((2, 8), 58, jnp.int32))
    summaries = window_attention_reference(q, k, v, jnp.zeros((2, 8), jnp.int32), jnp.full((2, 8), 4, jnp.int32))
    out, lse = merge_attention([window, own, summaries])
    visible = ranges_to_mask(starts, ends, 60) | ranges_to_mask(np.full((2, 8), 50), np.full((2, 8), 58), 60)
    visible |= ranges_to_mask(np.zeros((2, 8)), np.full((2, 8), 4), 60)
    dense_out, dense_lse = dense_attention(q, k, v, visible)
    np.testing.assert_allclose(out, dense_out, atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(lse, dense_lse, atol=3e-5, rtol=3e-5)


def test_work_skipping_bounds():
    """The kernels' loop bounds: a window of 16 over 256 keys with 16-wide blocks visits at most 2 key
    blocks per query block (not 16), and each key block is visited by at most 2 query blocks."""
    from specjax.pallas_kernels.window_attention.kernel import _key_block_ranges, _tiling

    tiling = _tiling(256, 256, SMALL_BLOCKS)
    starts, ends = sliding_window_ranges(jnp.arange(256, dtype=jnp.int32)[None], 16)
    (first_key, end_key), (first_query, end_query) = _key_block_ranges(starts, ends, tiling)
    assert int(jnp.max(end_key - first_key)) == 2
    assert int(jnp.max(end_query - first_query)) == 2
    assert int(first_key[0, 0]) == 0 and int(end_key[0, -1]) == 16


def test_dispatcher():
    q, k, v = make_qkv(np.random.default_rng(9), num_queries=5, num_keys=12)
    starts, ends = sliding_window_ranges(jnp.tile(jnp.arange(5, dtype=jnp.int32), (2, 1)), 3)
    jitted = jax.jit(lambda *a: window_attention_op(*a, implementation="pallas"))
    np.testing.assert_allclose(jitted(q, k, v, starts, ends)[0], window_attention_reference(q, k, v, starts, ends)[0],
                               **TOLERANCE[jnp.float32])
    with pytest.raises(ValueError, match="implementation='triton'"):
        window_attention_op(q, k, v, starts, ends, implementation="triton")


@pytest.mark.parametrize("case, match", [
    ("q3d", "q has shape"), ("kv_heads", "must divide"), ("v_shape", "v has shape"),
    ("starts_shape", "starts has shape"), ("ends_float", "ends has dtype"),
])
def test_bad_arguments_are_named(case, match):
    q, k, v = make_qkv(np.random.default_rng(10), num_queries=4, num_keys=8, num_heads=4, num_kv_heads=2)
    starts, ends = jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 4), jnp.int32)
    if case == "q3d":
        q = q[:, :, 0]
    elif case == "kv_heads":
        k = v = jnp.zeros((2, 8, 3, 16))
    elif case == "v_shape":
        v = v[:, :4]
    elif case == "starts_shape":
        starts = starts[:, :2]
    elif case == "ends_float":
        ends = ends.astype(jnp.float32)
    for implementation in ("xla", "pallas"):
        with pytest.raises(ValueError, match=match):
            window_attention_op(q, k, v, starts, ends, implementation=implementation)


def test_bad_window_and_block_sizes():
    with pytest.raises(ValueError, match="window must be"):
        sliding_window_ranges(jnp.zeros((1, 2), jnp.int32), 0)
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=24)


@pytest.mark.parametrize("dtype, scores", [(jnp.float32, AttentionScores()),
                                           (jnp.bfloat16, AttentionScores(scale=0.0625, softcap=50.0))])
def test_kernels_lower_to_triton_for_cuda(dtype, scores):
    """Lower (not compile) forward and backward for CUDA on this CPU machine: this runs the
    Pallas-to-Triton lowering, which rejects non-power-of-two tiles and primitives Triton lacks."""
    batch, num_queries, num_keys, num_heads, num_kv_heads, head_dim = 2, 300, 300, 9, 3, 64  # SmolLM2's heads
    spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    args = (spec(batch, num_queries, num_heads, head_dim), spec(batch, num_keys, num_kv_heads, head_dim),
            spec(batch, num_keys, num_kv_heads, head_dim), spec(batch, num_queries, dt=jnp.int32),
            spec(batch, num_queries, dt=jnp.int32))

    def loss(q, k, v, starts, ends):
        out, lse = window_attention(q, k, v, starts, ends, scores=scores, interpret=False)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("xla.gpu.triton") >= 3  # forward, dq, dk/dv
