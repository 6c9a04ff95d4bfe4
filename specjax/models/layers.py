"""Building blocks shared by the target and the drafters: RMSNorm, RoPE, GQA attention, gated MLPs."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.models.config import ACTIVATIONS, TransformerConfig, rope_inverse_frequencies
from specjax.pallas_kernels.scores import MASK_VALUE, STANDARD_SCORES, AttentionScores


MIN_DOT_ROWS = 4
"""bf16 projections run at least this many rows. XLA:CPU computes a row of a bf16 dot the same way
for any row count from 3 up (checked on SmolLM2's projection and head shapes, on this project's
Xeon), but one or two rows take other paths that round differently, and a lone row a slow
matrix-vector one (DESIGN.md section 8). Padding every smaller dot to 4 rows makes a row's value
independent of how many rows share its dot: a served row equals the same row decoded alone, and a
one-token step equals that token's row of a verify pass."""


def accumulate_in_float32(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`lax.dot_general` for low-precision (bf16) inputs: float32 accumulation and float32 output.

    On XLA:CPU a bf16 dot with a bf16 output runs far below a float32 one, while bf16 inputs
    accumulated in float32 take a fast path. A dot of fewer than MIN_DOT_ROWS rows is padded to
    that many with zero rows, which are dropped: a kept row's value does not depend on the pad.
    """
    del preferred_element_type  # always float32
    (lhs_contract, rhs_contract), (lhs_batch, _) = dimension_numbers
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dimension_numbers, precision=precision,
                            preferred_element_type=jnp.float32)
    count = lhs.size // max(lhs.shape[-1], 1) if lhs.ndim else 0
    if lhs_batch or tuple(lhs_contract) != (lhs.ndim - 1,) or count >= MIN_DOT_ROWS:
        return dot(lhs, rhs)
    rows = lhs.reshape(count, lhs.shape[-1])  # [M, d]
    padded = jnp.concatenate([rows, jnp.zeros((MIN_DOT_ROWS - count, lhs.shape[-1]), lhs.dtype)], axis=0)  # [4, d]
    out = jax.lax.dot_general(padded, rhs, (((1,), tuple(rhs_contract)), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32)  # [4, ...]
    return out[:count].reshape(lhs.shape[:-1] + out.shape[1:])


def dot_general_for(dtype) -> Callable:
    """The dot_general every projection of a model computing in `dtype` uses."""
    return jax.lax.dot_general if jnp.dtype(dtype) == jnp.float32 else accumulate_in_float32


def dense(features: int, use_bias: bool, dtype, name: str | None = None, **kwargs) -> nn.Dense:
    """A projection computing in `dtype`; in bf16 it accumulates in float32 and returns float32.
    kwargs go to nn.Dense (kernel_init, for example)."""
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, dot_general=dot_general_for(dtype), name=name,
                    **kwargs)


class RMSNorm(nn.Module):
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    unit_offset: bool = False
    """Gemma's form: multiply by (1 + scale) in float32, then cast (the weight is stored as is)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
        # HF casts back to the input dtype before multiplying by the weight; matching that order
        # keeps bf16 runs bit-compatible with the reference.
        return scale.astype(self.dtype) * normed.astype(self.dtype)


def rope_tables(config: TransformerConfig, positions: jax.Array, layer: int | None = None):
    """cos and sin for rotate-half RoPE of decoder layer `layer` (None: the model-wide base).
    positions: [B, T] -> two arrays [B, T, D/2]."""
    inv_freq = jnp.asarray(rope_inverse_frequencies(config, layer), jnp.float32)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [B, T, N, D]; cos, sin: [B, T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, D/2]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention_mask(write_index: jax.Array, num_new: int, max_length: int, block_mask: jax.Array | None):
    """Which cache slots each new token may attend to. Returns [B, T, S] bool.

    Slots before write_index[b] hold committed tokens and are always visible. The T new tokens sit at
    slots write_index[b] .. write_index[b]+T-1; among them the default is causal, and `block_mask`
    ([B, T, T], query x key within the new tokens) replaces that rule, e.g. with a tree's ancestor mask.
    Slots past the new tokens are never visible.
    """
    slots = jnp.arange(max_length, dtype=jnp.int32)  # [S]
    rel = slots[None, :] - write_index[:, None]  # [B, S]  slot offset inside the new block
    committed = (rel < 0)[:, None, :]  # [B, 1, S]
    if block_mask is None:
        query = jnp.arange(num_new, dtype=jnp.int32)[None, :, None]  # [1, T, 1]
        return committed | ((rel[:, None, :] >= 0) & (rel[:, None, :] <= query))
    in_block = (rel >= 0) & (rel < num_new)  # [B, S]
    gathered = jnp.take_along_axis(
        block_mask, jnp.broadcast_to(jnp.clip(rel, 0, num_new - 1)[:, None, :], (rel.shape[0], num_new, max_length)), axis=2
    )  # [B, T, S]
    return committed | (in_block[:, None, :] & gathered)


class PackedSlots(NamedTuple):
    """A full layer's view of the cache in which every query reads its visible new tokens packed into
    consecutive slots right after the committed prefix (`packed_slots`)."""

    source: jax.Array
    """[B, T, S] int32: the cache slot that attention position s of query t reads."""
    visible: jax.Array
    """[B, T, S] bool: whether query t attends to position s."""


def packed_slots(write_index: jax.Array, num_new: int, max_length: int, block_mask: jax.Array) -> PackedSlots:
    """attention_mask's visibility with each query's visible new tokens moved to consecutive positions.

    A tree node at depth d sees the committed prefix and its d ancestors. Under the plain mask those
    ancestors sit wherever the tree put them (slots write_index + node index); one token at a time,
    autoregressive decoding has the same tokens at slots write_index .. write_index + d. Softmax sums
    and the value dot are reductions over slots, and vectorised reductions (XLA:CPU on AVX-512 and AMX,
    measured) round differently when the same terms sit at other slots: bf16 trees then drifted from AR
    at near-ties. Packing gives every query AR's positions, so its sums round as AR's do.

    The new tokens a query sees are packed in index order, which is depth order whenever a parent's
    index is below its children's (true of every tree this project builds). A causal block packs to
    the identity. Returns PackedSlots with S = max_length."""
    batch = write_index.shape[0]
    slots = jnp.arange(max_length, dtype=jnp.int32)  # [S]
    rel = slots[None, :] - write_index[:, None]  # [B, S]  slot offset inside the new block
    in_block = (rel >= 0) & (rel < num_new)  # [B, S]
    # A stable sort on "not visible" lists each query's visible new tokens first, in index order.
    order = jnp.argsort(~block_mask, axis=-1, stable=True).astype(jnp.int32)  # [B, T, T]
    count = jnp.sum(block_mask, axis=-1, dtype=jnp.int32)  # [B, T] visible new tokens per query
    offset = jnp.broadcast_to(jnp.clip(rel, 0, num_new - 1)[:, None, :], (batch, num_new, max_length))
    picked = jnp.take_along_axis(order, offset, axis=2)  # [B, T, S]
    source = jnp.where(in_block[:, None, :], write_index[:, None, None] + picked, slots[None, None, :])
    visible = (rel < 0)[:, None, :] | (in_block[:, None, :] & (rel[:, None, :] < count[:, :, None]))
    return PackedSlots(source.astype(jnp.int32), visible)


def causal_block_mask(batch: int, num_new: int) -> jax.Array:
    """The default rule among T new tokens, each sees itself and those before it: [B, T, T] bool."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)), (batch, num_new, num_new))


def ring_slots(write_index: jax.Array, ring: int) -> jax.Array:
    """The slot each index of a ring of `ring` entries holds before this step's write: the latest
    slot below write_index[b] that maps to it (negative: never written). Returns [B, R] int32.

    With ring >= write_index (a layer with one index per slot) this is the identity below
    write_index and negative above it, so the same rule serves full-size sliding caches."""
    index = jnp.arange(ring, dtype=jnp.int32)[None, :]  # [1, R]
    w = write_index.astype(jnp.int32)[:, None]  # [B, 1]
    return w - ring + (index - w) % ring


def sliding_masks(write_index, positions, block_mask, window: int, ring: int):
    """What the new tokens of a sliding layer see, as two masks: (committed [B, T, R] over the ring
    as it was before this step's write, own [B, T, T] among the new tokens).

    Committed tokens sit at slot == position, so key slot s is visible from query position p iff
    p - window < s (HF's sliding_window semantics). Among the new tokens the rule is the block mask
    (causal when None), windowed by position: tree nodes sit at slot != position."""
    slots = ring_slots(write_index, ring)  # [B, R]
    committed = (slots >= 0)[:, None, :] & (slots[:, None, :] > positions[:, :, None] - window)  # [B, T, R]
    if block_mask is None:
        block_mask = causal_block_mask(*positions.shape)
    own = block_mask & (positions[:, None, :] > positions[:, :, None] - window)  # [B, T, T] query x key
    return committed, own


def grouped_query_attention(q, k, v, mask, scores: AttentionScores = STANDARD_SCORES):
    """q: [B, T, H, D]; k, v: [B, S, K, D]; mask: [B, T, S] -> [B, T, H, D]. scores: the logits'
    scale and optional soft cap."""
    if stacked_heads_pays(q.shape[0], q.shape[1], k.shape[2]):
        return stacked_heads_attention(q, k, v, mask, scores)
    return per_head_attention(q, k, v, mask, scores)


def _per_head_logits(q, k, scores: AttentionScores):
    """Unmasked attention logits, one einsum per KV head group: q [B, T, H, D], k [B, S, K, D] ->
    [B, K, G, T, S] float32 (G = H / K query heads per KV head)."""
    batch, num_new, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    q = q.reshape(batch, num_new, num_kv, num_heads // num_kv, head_dim)  # [B, T, K, G, D]
    products = jnp.einsum("BTKGD,BSKD->BKGTS", q, k, preferred_element_type=jnp.float32)
    return scores.logits(products, head_dim)


def per_head_attention(q, k, v, mask, scores: AttentionScores = STANDARD_SCORES):
    """grouped_query_attention as one einsum per KV head group (its default form); same shapes."""
    logits = jnp.where(mask[:, None, None, :, :], _per_head_logits(q, k, scores), MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape)


def packed_attention(q, k, v, packed: PackedSlots, scores: AttentionScores = STANDARD_SCORES):
    """per_head_attention over the slot order of `packed` (see packed_slots): q [B, T, H, D]; k, v
    [B, S, K, D] -> [B, T, H, D]. Scores are computed against the cache as it is and then moved; values
    are gathered per query ([B, T, S, K, D], T copies of the read slots), so the value dot reduces
    over the same positions as AR's. That copy is the price of exact trees."""
    logits = jnp.take_along_axis(_per_head_logits(q, k, scores), packed.source[:, None, None], axis=-1)
    logits = jnp.where(packed.visible[:, None, None], logits, MASK_VALUE)  # [B, K, G, T, S]
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    per_query = jnp.take_along_axis(v[:, None], packed.source[:, :, :, None, None], axis=2)  # [B, T, S, K, D]
    out = jnp.einsum("BKGTS,BTSKD->BTKGD", probs, per_query, preferred_element_type=jnp.float32)
    return out.reshape(q.shape)


STACKED_HEADS_MIN_BATCH = 16
"""Batched one-token steps of at least this many rows take `stacked_heads_attention` on CPU."""


def stacked_heads_pays(batch: int, num_new: int, num_kv: int) -> bool:
    """Whether `stacked_heads_attention` is the faster form for these (static) shapes.

    XLA:CPU runs the per-head einsums as batched dots whose batch dimensions (row, KV head) are not
    the cache's leading ones, so it copies each layer's whole [B, S, K, D] cache into [B, K, S, D]
    order first, every step. With 16 or more rows of one token the stacked form was faster in float32
    (1.6-1.8x a layer at 16, 32 and 128 rows, SmolLM2's heads) and mostly in bf16 (1.1-1.6x; 0.87x
    once, at 64 rows): experiments/attention_forms.py, docs/notes/2026-12-06-generator-throughput.md.
    With one row, or a verify block of many tokens, the per-head form was as fast or faster; on GPU
    and TPU the stacked form's K-fold products would be waste."""
    return jax.default_backend() == "cpu" and num_new == 1 and batch >= STACKED_HEADS_MIN_BATCH and num_kv <= 4


def stacked_heads_attention(q, k, v, mask, scores: AttentionScores = STANDARD_SCORES):
    """grouped_query_attention with the KV heads kept stacked in one feature axis, so every dot
    contracts the cache's contiguous last axes and reads it in place. Each query head is spread into a
    block-diagonal row over the K*D stacked features (zeros outside its own KV head), so one dot per
    row gives every head's scores, and the values' dot gives every head's outputs, of which each
    query head keeps its own block. It does K times the products, and no copy of the cache.
    Same shapes as grouped_query_attention."""
    batch, num_new, num_heads, head_dim = q.shape
    slots, num_kv = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    own_head = jnp.eye(num_kv, dtype=q.dtype)  # [K, K]
    q = q.reshape(batch, num_new, num_kv, group, 1, head_dim) * own_head[None, None, :, None, :, None]
    q = q.reshape(batch, num_new * num_heads, num_kv * head_dim)  # [B, T*H, K*D], block-diagonal rows
    products = jnp.einsum("BQE,BSE->BQS", q, k.reshape(batch, slots, num_kv * head_dim),
                          preferred_element_type=jnp.float32)  # [B, T*H, S]
    visible = jnp.repeat(mask, num_heads, axis=1)  # [B, T*H, S]
    logits = jnp.where(visible, scores.logits(products, head_dim), MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("BQS,BSE->BQE", probs, v.reshape(batch, slots, num_kv * head_dim),
                     preferred_element_type=jnp.float32)  # [B, T*H, K*D]
    out = out.reshape(batch, num_new, num_kv, group, num_kv, head_dim)
    out = jnp.einsum("BTKGLD,KL->BTKGD", out, own_head.astype(out.dtype))  # each head's own block
    return out.reshape(batch, num_new, num_heads, head_dim)


ACTIVATION_FUNCTIONS = {
    "silu": nn.silu,
    # HF's gelu_pytorch_tanh is the tanh approximation of GELU.
    "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
}
assert set(ACTIVATION_FUNCTIONS) == set(ACTIVATIONS), "config.ACTIVATIONS and the implementations must agree"


class SwiGLU(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU (Gemma) with gelu_pytorch_tanh."""

    intermediate_size: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    activation: str = "silu"

    @nn.compact
    def __call__(self, x):
        dense_ = lambda n, name: dense(n, self.use_bias, self.dtype, name)
        act = ACTIVATION_FUNCTIONS[self.activation]
        hidden = act(dense_(self.intermediate_size, "gate_proj")(x)) * dense_(self.intermediate_size, "up_proj")(x)
        return dense_(x.shape[-1], "down_proj")(hidden)
