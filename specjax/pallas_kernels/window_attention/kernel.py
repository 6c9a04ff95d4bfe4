"""Pallas (Triton) kernels for windowed attention, forward and backward, under one `jax.custom_vjp`.

Semantics are those of `reference.window_attention_reference`: query i of row b sees the keys
starts[b, i] .. ends[b, i] - 1. The window is structure, not a dense mask. Before launch, the wrapper
reduces the ranges of each block of block_q queries to one range of key blocks,
[first_block, end_block) (a [B, num_q_blocks] array each), and each program walks only those key
blocks. A sliding window of W keys over a sequence of S therefore costs O(S * W) instead of O(S^2). The
per-element range test inside a block handles ragged edges.

Launch layout, shared by the three kernels:
- forward and dq: grid (query block, batch row, query head). The program holds its [block_q, D]
  queries and loops over its key blocks (online softmax in the forward; dq accumulation in the
  backward, FlashAttention-2 style, from the saved log-sum-exp).
- dk/dv: grid (key block, batch row, query head). The program holds one [block_k, D] block of keys
  and values and loops over the query blocks whose key range touches it; that range of query blocks
  is precomputed the same way. Grouped-query heads are summed outside the kernel (dk of kv head k is
  the sum over its G query heads), which costs a G-times larger temporary but keeps the kernel free
  of cross-program reductions.
- grouped-query attention is handled by the index maps: query head h reads kv head h // G.
- every tile has power-of-two sides, as the Triton lowering requires; the wrapper pads T and S
  (padding queries have empty ranges, padding keys are outside every range).

The backward needs delta_i = sum_d dO[i, d] * O[i, d] - dlse[i] (the log-sum-exp is an output too,
so its cotangent enters here). That row reduction is cheap and is done in jnp before the launch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.pallas_kernels.scores import STANDARD_SCORES, AttentionScores
from specjax.pallas_kernels.tiling import check_block_sizes, check_head_dim, clamped_block, round_up

from specjax.pallas_kernels.tree_attention.reference import MASK_VALUE
from specjax.pallas_kernels.window_attention.reference import check_window_attention_shapes

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling and launch parameters of the windowed-attention kernels; tune per model and GPU."""

    block_q: int = 64
    """Queries per program (forward and dq) and per step of the dk/dv loop. Power of two, >= 16;
    clamped down to what the padded query axis needs."""
    block_k: int = 64
    """Keys per step of the forward and dq loops, and per dk/dv program. Power of two, >= 16. The
    window's ragged edges waste at most one block per side, so smaller blocks suit small windows."""
    num_warps: int = 4
    """Warps per program (Triton launch parameter)."""
    num_stages: int = 2
    """Software-pipelining depth of the key loop (Triton launch parameter)."""

    def __post_init__(self):
        check_block_sizes(self)


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Padded extents and block sizes of one call (static)."""

    block_q: int
    block_k: int
    padded_queries: int
    padded_keys: int
    num_warps: int
    num_stages: int

    @property
    def num_q_blocks(self) -> int:
        return self.padded_queries // self.block_q

    @property
    def num_k_blocks(self) -> int:
        return self.padded_keys // self.block_k

    @property
    def compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _tiling(num_queries: int, num_keys: int, block_sizes: BlockSizes) -> _Tiling:
    block_q = clamped_block(block_sizes.block_q, num_queries)
    block_k = clamped_block(block_sizes.block_k, num_keys)
    return _Tiling(block_q, block_k, round_up(num_queries, block_q), round_up(num_keys, block_k),
                   block_sizes.num_warps, block_sizes.num_stages)


def _key_block_ranges(starts, ends, tiling: _Tiling):
    """Per query block, the key blocks its queries can see: (first [B, nQ], end [B, nQ]) int32, with
    first == end for a block of empty ranges. Per key block, the query blocks that can see it:
    (first [B, nK], end [B, nK]). starts/ends are already padded and clipped to [0, S]."""
    batch = starts.shape[0]
    nonempty = starts < ends  # [B, T_pad]
    big = jnp.int32(tiling.padded_keys)
    q_starts = jnp.where(nonempty, starts, big).reshape(batch, tiling.num_q_blocks, tiling.block_q)
    q_ends = jnp.where(nonempty, ends, 0).reshape(batch, tiling.num_q_blocks, tiling.block_q)
    first_key = jnp.min(q_starts, axis=2) // tiling.block_k  # [B, nQ]
    end_key = -(-jnp.max(q_ends, axis=2) // tiling.block_k)  # [B, nQ]  ceil
    first_key = jnp.minimum(first_key, end_key)  # a block of empty ranges: first == end == 0
    key_block = jnp.arange(tiling.num_k_blocks, dtype=jnp.int32)  # [nK]
    touches = (first_key[:, :, None] <= key_block) & (key_block < end_key[:, :, None])  # [B, nQ, nK]
    q_block = jnp.arange(tiling.num_q_blocks, dtype=jnp.int32)[None, :, None]
    any_touch = jnp.any(touches, axis=1)  # [B, nK]
    first_query = jnp.where(any_touch, jnp.min(jnp.where(touches, q_block, tiling.num_q_blocks), axis=1), 0)
    end_query = jnp.where(any_touch, jnp.max(jnp.where(touches, q_block + 1, 0), axis=1), 0)
    return ((first_key.astype(jnp.int32), end_key.astype(jnp.int32)),
            (first_query.astype(jnp.int32), end_query.astype(jnp.int32)))


def _forward_kernel(first_ref, end_ref, starts_ref, ends_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *,
                    block_k: int, scores: AttentionScores):
    # first_ref, end_ref: [] key-block range; starts_ref, ends_ref: [block_q]; q_ref: [block_q, D];
    # k_ref, v_ref: [S_pad, D] (this row, this head's kv head); out_ref: [block_q, D]; lse_ref: [block_q]
    block_q, head_dim = q_ref.shape
    q = q_ref[...]
    starts, ends = starts_ref[...], ends_ref[...]

    def key_block(index, carry):
        acc, running_max, running_sum = carry
        start = index * block_k
        keys = k_ref[pl.ds(start, block_k), :]  # [block_k, D]
        values = v_ref[pl.ds(start, block_k), :]  # [block_k, D]
        key_index = start + jnp.arange(block_k, dtype=jnp.int32)
        visible = (key_index[None, :] >= starts[:, None]) & (key_index[None, :] < ends[:, None])  # [block_q, block_k]
        products = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = jnp.where(visible, scores.logits(products, head_dim), MASK_VALUE)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))
        correction = jnp.exp(running_max - new_max)
        probs = jnp.where(visible, jnp.exp(logits - new_max[:, None]), 0.0)  # [block_q, block_k]
        running_sum = correction * running_sum + jnp.sum(probs, axis=1)
        acc = correction[:, None] * acc + jnp.dot(probs.astype(values.dtype), values,
                                                  preferred_element_type=jnp.float32)
        return acc, new_max, running_sum

    carry = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    acc, running_max, running_sum = lax.fori_loop(first_ref[()], end_ref[()], key_block, carry)
    seen = running_sum > 0.0
    safe_sum = jnp.where(seen, running_sum, 1.0)
    out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, running_max + jnp.log(safe_sum), MASK_VALUE)


def _dq_kernel(first_ref, end_ref, starts_ref, ends_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               block_k: int, scores: AttentionScores):
    # As the forward, plus do_ref: [block_q, D], lse_ref/delta_ref: [block_q]; dq_ref: [block_q, D] float32.
    block_q, head_dim = q_ref.shape
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    starts, ends = starts_ref[...], ends_ref[...]

    def key_block(index, dq):
        start = index * block_k
        keys = k_ref[pl.ds(start, block_k), :]
        values = v_ref[pl.ds(start, block_k), :]
        key_index = start + jnp.arange(block_k, dtype=jnp.int32)
        visible = (key_index[None, :] >= starts[:, None]) & (key_index[None, :] < ends[:, None])
        products = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = jnp.where(visible, scores.logits(products, head_dim), 0.0)
        probs = jnp.where(visible, jnp.exp(logits - lse[:, None]), 0.0)  # [block_q, block_k]
        dprobs = lax.dot_general(do, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        # Gradient with respect to the scaled, uncapped score: the cap's derivative enters here.
        dscaled = probs * (dprobs - delta[:, None]) * scores.capped_gradient(logits)  # [block_q, block_k]
        return dq + jnp.dot(dscaled.astype(keys.dtype), keys, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(first_ref[()], end_ref[()], key_block, jnp.zeros((block_q, head_dim), jnp.float32))
    dq_ref[...] = dq * scores.scale_for(head_dim)


def _dkv_kernel(first_ref, end_ref, starts_ref, ends_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, block_q: int, scores: AttentionScores):
    # first_ref, end_ref: [] query-block range; starts_ref, ends_ref, lse_ref, delta_ref: [T_pad];
    # q_ref, do_ref: [T_pad, D] (this row and head); k_ref, v_ref: [block_k, D]; dk_ref, dv_ref: [block_k, D] float32.
    block_k, head_dim = k_ref.shape
    keys, values = k_ref[...], v_ref[...]
    key_index = pl.program_id(0) * block_k + jnp.arange(block_k, dtype=jnp.int32)

    def query_block(index, carry):
        dk, dv = carry
        start = index * block_q
        q = q_ref[pl.ds(start, block_q), :]  # [block_q, D]
        do = do_ref[pl.ds(start, block_q), :]
        lse = lse_ref[pl.ds(start, block_q)]
        delta = delta_ref[pl.ds(start, block_q)]
        starts = starts_ref[pl.ds(start, block_q)]
        ends = ends_ref[pl.ds(start, block_q)]
        visible = (key_index[None, :] >= starts[:, None]) & (key_index[None, :] < ends[:, None])  # [block_q, block_k]
        products = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = jnp.where(visible, scores.logits(products, head_dim), 0.0)
        probs = jnp.where(visible, jnp.exp(logits - lse[:, None]), 0.0)
        dv = dv + lax.dot_general(probs.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)  # [block_k, D]
        dprobs = lax.dot_general(do, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dscaled = probs * (dprobs - delta[:, None]) * scores.capped_gradient(logits)
        dk = dk + lax.dot_general(dscaled.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros((block_k, head_dim), jnp.float32)
    dk, dv = lax.fori_loop(first_ref[()], end_ref[()], query_block, (zeros, zeros))
    dk_ref[...] = dk * scores.scale_for(head_dim)
    dv_ref[...] = dv


def _pad_axis1(x, target):
    if x.shape[1] == target:
        return x
    return jnp.pad(x, [(0, 0), (0, target - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _prepared(q, k, v, starts, ends, block_sizes: BlockSizes):
    """Pad everything to the tiling and clip the ranges. Returns (tiling, q, k, v, starts, ends, ranges)."""
    dims = check_window_attention_shapes(q, k, v, starts, ends)
    tiling = _tiling(dims.num_queries, dims.num_keys, block_sizes)
    starts = jnp.clip(starts.astype(jnp.int32), 0, dims.num_keys)
    ends = jnp.clip(ends.astype(jnp.int32), 0, dims.num_keys)
    # Padding queries get the empty range [0, 0).
    starts, ends = _pad_axis1(starts, tiling.padded_queries), _pad_axis1(ends, tiling.padded_queries)
    q, k, v = _pad_axis1(q, tiling.padded_queries), _pad_axis1(k, tiling.padded_keys), _pad_axis1(v, tiling.padded_keys)
    return dims, tiling, q, k, v, starts, ends, _key_block_ranges(starts, ends, tiling)


def _kv_head(head, group_size):
    return lax.div(head, group_size)  # a plain sdiv in Triton, unlike `//`


def _forward(q, k, v, starts, ends, block_sizes: BlockSizes, scores: AttentionScores, interpret: bool):
    dims, tiling, q_p, k_p, v_p, starts_p, ends_p, ((first_key, end_key), _) = _prepared(q, k, v, starts, ends, block_sizes)
    group, head_dim = dims.group_size, dims.head_dim
    kernel = functools.partial(_forward_kernel, block_k=tiling.block_k, scores=scores)
    out, lse = pl.pallas_call(
        kernel,
        grid=(tiling.num_q_blocks, dims.batch, dims.num_heads),
        in_specs=[
            pl.BlockSpec((None, None), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, None), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, tiling.block_q), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, tiling.block_q), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, tiling.block_q, None, head_dim), lambda qb, b, h: (b, qb, h, 0)),
            pl.BlockSpec((None, tiling.padded_keys, None, head_dim), lambda qb, b, h: (b, 0, _kv_head(h, group), 0)),
            pl.BlockSpec((None, tiling.padded_keys, None, head_dim), lambda qb, b, h: (b, 0, _kv_head(h, group), 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, tiling.block_q, None, head_dim), lambda qb, b, h: (b, qb, h, 0)),
            pl.BlockSpec((None, None, tiling.block_q), lambda qb, b, h: (b, h, qb)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q_p.shape, q.dtype),
                   jax.ShapeDtypeStruct((dims.batch, dims.num_heads, tiling.padded_queries), jnp.float32)],
        compiler_params=tiling.compiler_params,
        interpret=interpret,
        name="window_attention_forward",
    )(first_key, end_key, starts_p, ends_p, q_p, k_p, v_p)
    num_queries = dims.num_queries
    return out[:, :num_queries], jnp.transpose(lse, (0, 2, 1))[:, :num_queries]  # [B, T, H, D], [B, T, H]


def _backward(q, k, v, starts, ends, out, lse, d_out, d_lse, block_sizes: BlockSizes, scores: AttentionScores,
              interpret: bool):
    dims, tiling, q_p, k_p, v_p, starts_p, ends_p, ranges = _prepared(q, k, v, starts, ends, block_sizes)
    (first_key, end_key), (first_query, end_query) = ranges
    group, head_dim = dims.group_size, dims.head_dim
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse  # [B, T, H]
    pad_rows = lambda x: _pad_axis1(x, tiling.padded_queries)
    do_p = pad_rows(d_out.astype(q.dtype))  # [B, T_pad, H, D]
    lse_p = jnp.transpose(pad_rows(lse), (0, 2, 1))  # [B, H, T_pad]
    delta_p = jnp.transpose(pad_rows(delta), (0, 2, 1))  # [B, H, T_pad]

    q_block = lambda qb, b, h: (b, qb, h, 0)
    kv_full = lambda qb, b, h: (b, 0, _kv_head(h, group), 0)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=tiling.block_k, scores=scores),
        grid=(tiling.num_q_blocks, dims.batch, dims.num_heads),
        in_specs=[
            pl.BlockSpec((None, None), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, None), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, tiling.block_q), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, tiling.block_q), lambda qb, b, h: (b, qb)),
            pl.BlockSpec((None, tiling.block_q, None, head_dim), q_block),
            pl.BlockSpec((None, tiling.padded_keys, None, head_dim), kv_full),
            pl.BlockSpec((None, tiling.padded_keys, None, head_dim), kv_full),
            pl.BlockSpec((None, tiling.block_q, None, head_dim), q_block),
            pl.BlockSpec((None, None, tiling.block_q), lambda qb, b, h: (b, h, qb)),
            pl.BlockSpec((None, None, tiling.block_q), lambda qb, b, h: (b, h, qb)),
        ],
        out_specs=pl.BlockSpec((None, tiling.block_q, None, head_dim), q_block),
        out_shape=jax.ShapeDtypeStruct(q_p.shape, jnp.float32),
        compiler_params=tiling.compiler_params,
        interpret=interpret,
        name="window_attention_dq",
    )(first_key, end_key, starts_p, ends_p, q_p, k_p, v_p, do_p, lse_p, delta_p)

    k_block = lambda kb, b, h: (b, kb, h, 0)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=tiling.block_q, scores=scores),
        grid=(tiling.num_k_blocks, dims.batch, dims.num_heads),
        in_specs=[
            pl.BlockSpec((None, None), lambda kb, b, h: (b, kb)),
            pl.BlockSpec((None, None), lambda kb, b, h: (b, kb)),
            pl.BlockSpec((None, tiling.padded_queries), lambda kb, b, h: (b, 0)),
            pl.BlockSpec((None, tiling.padded_queries), lambda kb, b, h: (b, 0)),
            pl.BlockSpec((None, tiling.padded_queries, None, head_dim), lambda kb, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, tiling.block_k, None, head_dim), lambda kb, b, h: (b, kb, _kv_head(h, group), 0)),
            pl.BlockSpec((None, tiling.block_k, None, head_dim), lambda kb, b, h: (b, kb, _kv_head(h, group), 0)),
            pl.BlockSpec((None, tiling.padded_queries, None, head_dim), lambda kb, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, None, tiling.padded_queries), lambda kb, b, h: (b, h, 0)),
            pl.BlockSpec((None, None, tiling.padded_queries), lambda kb, b, h: (b, h, 0)),
        ],
        out_specs=[pl.BlockSpec((None, tiling.block_k, None, head_dim), k_block),
                   pl.BlockSpec((None, tiling.block_k, None, head_dim), k_block)],
        out_shape=[jax.ShapeDtypeStruct((dims.batch, tiling.padded_keys, dims.num_heads, head_dim), jnp.float32)] * 2,
        compiler_params=tiling.compiler_params,
        interpret=interpret,
        name="window_attention_dkv",
    )(first_query, end_query, starts_p, ends_p, q_p, k_p, v_p, do_p, lse_p, delta_p)

    def sum_groups(x):  # [B, S_pad, H, D] per query head -> [B, S, Kh, D] per kv head
        x = x[:, :dims.num_keys].reshape(dims.batch, dims.num_keys, dims.num_kv_heads, group, head_dim)
        return jnp.sum(x, axis=3).astype(k.dtype)

    return dq[:, :dims.num_queries].astype(q.dtype), sum_groups(dk), sum_groups(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _window_attention(q, k, v, starts, ends, block_sizes, scores, interpret):
    return _forward(q, k, v, starts, ends, block_sizes, scores, interpret)


def _window_attention_fwd(q, k, v, starts, ends, block_sizes, scores, interpret):
    out, lse = _forward(q, k, v, starts, ends, block_sizes, scores, interpret)
    return (out, lse), (q, k, v, starts, ends, out, lse)


def _window_attention_bwd(block_sizes, scores, interpret, residuals, cotangents):
    q, k, v, starts, ends, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(q, k, v, starts, ends, out, lse, d_out, d_lse.astype(jnp.float32), block_sizes, scores,
                           interpret)
    return dq, dk, dv, None, None


_window_attention.defvjp(_window_attention_fwd, _window_attention_bwd)


@functools.partial(jax.jit, static_argnames=("block_sizes", "scores", "interpret"))
def window_attention(q, k, v, starts, ends, *, block_sizes: BlockSizes = BlockSizes(),
                     scores: AttentionScores = STANDARD_SCORES, interpret: bool | None = None):
    """Windowed attention with the Pallas kernels. Same arguments and results as
    `window_attention_reference`: (out [B, T, H, D], lse [B, T, H] float32); differentiable in q, k
    and v (the backward is two more kernels).

    q: [B, T, H, D]; k, v: [B, S, Kh, D]; starts, ends: [B, T] int, clipped to [0, S]. scores: the
    scale and optional soft cap of the logits (see `AttentionScores`). interpret=None runs the Pallas
    interpreter when the default backend is the CPU and compiles with Triton otherwise.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    head_dim = q.shape[-1]
    if not interpret:
        check_head_dim(head_dim)
    return _window_attention(q, k, v, starts, ends, block_sizes, scores, interpret)
