"""Pallas (Triton) kernel for tree attention: T new tokens over a ragged committed cache prefix plus themselves.

Semantics are those of `reference.tree_attention_reference`. What the kernel adds is work skipping: the
KV cache is allocated for the longest sequence, but row b only needs its first prefix_lengths[b] slots,
so each program walks ceil(prefix_lengths[b] / block_k) cache blocks (a dynamic trip count) instead of
all S / block_k of them. XLA's dense attention always reads and scores the whole cache.

Layout of the launch:
- grid (query block, batch row, query head): one program owns block_q queries of one head. The query
  block varies fastest so that neighbouring programs read the same cache row and head, which keeps the
  cache in L2 for them.
- grouped-query attention is handled by the index maps: query head h reads kv head h // G.
- every tile the kernel loads or computes on ([block_q, D], [block_k, D], [block_q, block_k],
  [block_q, block_q]) has power-of-two sides, as the Triton lowering requires; the wrapper pads T up
  to a multiple of block_q and S up to a multiple of block_k and slices the padding off the output.

Inside a program (online softmax, FlashAttention style, all running state in float32):
1. cache blocks 0 .. ceil(prefix / block_k) - 1, the last one masked by slot < prefix;
2. the T_pad tree keys in [block_q]-wide blocks, masked by the tree mask (padding keys are hidden);
3. divide by the running sum, which is zero only for a query that saw nothing; that row gives zeros.
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

from specjax.pallas_kernels.tree_attention.reference import MASK_VALUE, check_tree_attention_shapes

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling and launch parameters of the tree-attention kernel; tune per model and GPU."""

    block_q: int = 64
    """Queries (tree nodes) per program; also the width of one block of tree keys. Power of two, >= 16.
    Clamped down to the next power of two >= max(T, 16), so a decode step (T=1) pads to 16 rows, not 64."""
    block_k: int = 64
    """Cache slots per step of the prefix loop. Power of two, >= 16. Smaller blocks waste less on the
    last, partially visible block; larger ones make fewer, bigger matmuls. Clamped like block_q against S."""
    num_warps: int = 4
    """Warps per program (Triton launch parameter). 4 suits head_dim 64 with 64 x 64 tiles."""
    num_stages: int = 2
    """Software-pipelining depth of the prefix loop (Triton launch parameter)."""

    def __post_init__(self):
        check_block_sizes(self)


def _tree_attention_kernel(
    prefix_length_ref,  # [] int32: committed cache slots of this batch row
    q_ref,  # [block_q, D]
    cache_k_ref,  # [S_pad, D] (this row, this query head's kv head)
    cache_v_ref,  # [S_pad, D]
    tree_k_ref,  # [T_pad, D]
    tree_v_ref,  # [T_pad, D]
    tree_mask_ref,  # [block_q, T_pad] int8, nonzero = visible
    out_ref,  # [block_q, D]
    *,
    block_k: int,
    scores: AttentionScores,
):
    block_q, head_dim = q_ref.shape
    num_tree_blocks = tree_k_ref.shape[0] // block_q
    prefix_length = prefix_length_ref[()]
    q = q_ref[...]  # [block_q, D], stays in registers for the whole program

    def attend(keys, values, visible, carry):
        """Fold one block of keys into the running softmax. keys, values: [N, D]; visible: broadcasts to [block_q, N]."""
        acc, running_max, running_sum = carry
        products = lax.dot_general(
            q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [block_q, N]
        # Replace rather than add: garbage keys past the prefix may have produced inf or NaN scores.
        logits = jnp.where(visible, scores.logits(products, head_dim), MASK_VALUE)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))  # [block_q]
        # Both maxima are finite (MASK_VALUE at worst), so this never computes inf - inf.
        correction = jnp.exp(running_max - new_max)  # [block_q]
        # The where keeps a row whose keys are all hidden at exactly zero weight: with a finite mask
        # value, exp(MASK_VALUE - MASK_VALUE) would otherwise count each hidden key as 1.
        probs = jnp.where(visible, jnp.exp(logits - new_max[:, None]), 0.0)  # [block_q, N]
        running_sum = correction * running_sum + jnp.sum(probs, axis=1)
        # Probabilities go to the value dtype before the product, as in the model's XLA attention.
        update = jnp.dot(probs.astype(values.dtype), values, preferred_element_type=jnp.float32)  # [block_q, D]
        acc = correction[:, None] * acc + update
        return acc, new_max, running_sum

    def prefix_block(block_index, carry):
        start = block_index * block_k
        keys = cache_k_ref[pl.ds(start, block_k), :]  # [block_k, D]
        values = cache_v_ref[pl.ds(start, block_k), :]  # [block_k, D]
        slots = start + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        # Only the last block is partial, but an always-on mask is cheaper than a branch.
        return attend(keys, values, (slots < prefix_length)[None, :], carry)

    def tree_block(block_index, carry):
        start = block_index * block_q
        keys = tree_k_ref[pl.ds(start, block_q), :]  # [block_q, D]
        values = tree_v_ref[pl.ds(start, block_q), :]  # [block_q, D]
        visible = tree_mask_ref[:, pl.ds(start, block_q)] != 0  # [block_q, block_q]
        return attend(keys, values, visible, carry)

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),  # unnormalised output
        jnp.full((block_q,), MASK_VALUE, jnp.float32),  # running max of the scores
        jnp.zeros((block_q,), jnp.float32),  # running softmax denominator
    )
    # ceil(prefix / block_k) without `//`, which traces to a floor-division with sign fix-ups; the
    # prefix is clamped to [0, S] by the wrapper so truncating division is exact here.
    num_prefix_blocks = lax.div(prefix_length + (block_k - 1), block_k)
    carry = lax.fori_loop(0, num_prefix_blocks, prefix_block, carry)
    carry = lax.fori_loop(0, num_tree_blocks, tree_block, carry)
    acc, _, running_sum = carry
    safe_sum = jnp.where(running_sum == 0.0, 1.0, running_sum)  # zero only when a query saw nothing
    out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "scores", "interpret", "debug"))
def tree_attention(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    prefix_lengths: jax.Array,
    tree_k: jax.Array,
    tree_v: jax.Array,
    tree_mask: jax.Array,
    *,
    block_sizes: BlockSizes = BlockSizes(),
    scores: AttentionScores = STANDARD_SCORES,
    interpret: bool | None = None,
    debug: bool = False,
) -> jax.Array:
    """Tree attention with the Pallas kernel. Same arguments and result as `tree_attention_reference`.

    q: [B, T, H, D]; cache_k, cache_v: [B, S, Kh, D]; prefix_lengths: [B] int; tree_k, tree_v:
    [B, T, Kh, D]; tree_mask: [B, T, T] bool; scores: the logits' scale and optional soft cap.
    Returns [B, T, H, D] in q.dtype. prefix_lengths are clamped to [0, S]. interpret=None runs the
    Pallas interpreter when the default backend is the CPU and compiles with Triton otherwise;
    debug=True prints the kernel's jaxpr and lowered IR.

    Choosing S as a multiple of block_sizes.block_k avoids a padded copy of the cache on every call.
    float32 matmuls follow `jax_default_matmul_precision` like XLA's do: TF32 on NVIDIA GPUs unless it
    is "highest" (then IEEE float32).
    """
    # Kept whole (over 80 lines): the padded shapes and the BlockSpecs below are one contract with
    # the kernel's index maps and block loops, and read best side by side.
    dims = check_tree_attention_shapes(q, cache_k, cache_v, prefix_lengths, tree_k, tree_v, tree_mask)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if not interpret:
        check_head_dim(dims.head_dim)
    batch, num_new, cache_length = dims.batch, dims.num_new, dims.cache_length
    group_size = dims.group_size

    block_q = clamped_block(block_sizes.block_q, num_new)
    block_k = clamped_block(block_sizes.block_k, cache_length)
    padded_new = round_up(num_new, block_q)
    padded_cache = max(round_up(cache_length, block_k), block_k)  # S = 0 still gets one (skipped) block

    def pad_axis1(x, target):  # zero-pad axis 1 of a [B, N, ...] array up to `target`
        if x.shape[1] == target:
            return x
        return jnp.pad(x, [(0, 0), (0, target - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    q_padded = pad_axis1(q, padded_new)  # [B, T_pad, H, D]
    tree_k_padded = pad_axis1(tree_k, padded_new)  # [B, T_pad, Kh, D]
    tree_v_padded = pad_axis1(tree_v, padded_new)  # [B, T_pad, Kh, D]
    # int8 rather than bool: a plain byte load in Triton. Padding rows and columns are 0, i.e. hidden.
    tree_mask_padded = jnp.pad(
        tree_mask.astype(jnp.int8), [(0, 0), (0, padded_new - num_new), (0, padded_new - num_new)]
    )  # [B, T_pad, T_pad]
    cache_k_padded = pad_axis1(cache_k, padded_cache)  # [B, S_pad, Kh, D]
    cache_v_padded = pad_axis1(cache_v, padded_cache)  # [B, S_pad, Kh, D]
    # Clamping to S keeps the zero padding of the cache out of sight when a caller passes prefix > S.
    prefix_clamped = jnp.clip(prefix_lengths.astype(jnp.int32), 0, cache_length)  # [B]

    head_dim = dims.head_dim
    def kv_head(head):
        # lax.div is a plain sdiv in Triton; `//` would trace to a floor division with sign fix-ups.
        return lax.div(head, group_size)

    in_specs = [
        pl.BlockSpec((None,), lambda qb, b, h: (b,)),
        pl.BlockSpec((None, block_q, None, head_dim), lambda qb, b, h: (b, qb, h, 0)),
        pl.BlockSpec((None, padded_cache, None, head_dim), lambda qb, b, h: (b, 0, kv_head(h), 0)),
        pl.BlockSpec((None, padded_cache, None, head_dim), lambda qb, b, h: (b, 0, kv_head(h), 0)),
        pl.BlockSpec((None, padded_new, None, head_dim), lambda qb, b, h: (b, 0, kv_head(h), 0)),
        pl.BlockSpec((None, padded_new, None, head_dim), lambda qb, b, h: (b, 0, kv_head(h), 0)),
        pl.BlockSpec((None, block_q, padded_new), lambda qb, b, h: (b, qb, 0)),
    ]
    out_spec = pl.BlockSpec((None, block_q, None, head_dim), lambda qb, b, h: (b, qb, h, 0))
    kernel = functools.partial(_tree_attention_kernel, block_k=block_k, scores=scores)
    out = pl.pallas_call(
        kernel,
        grid=(padded_new // block_q, batch, dims.num_heads),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        debug=debug,
        name="tree_attention",
    )(prefix_clamped, q_padded, cache_k_padded, cache_v_padded, tree_k_padded, tree_v_padded, tree_mask_padded)
    return out[:, :num_new]  # [B, T, H, D]
