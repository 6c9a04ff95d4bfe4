"""Plain-jnp windowed attention: the semantics the Pallas kernel reproduces, and the "xla" implementation.

Every query row sees one contiguous range of keys: query i of batch row b attends to keys j with
starts[b, i] <= j < ends[b, i]. One range per query covers every pattern the models need:

- a causal sliding window of W keys (HF's `sliding_window`): query at key index p sees (p - W, p];
- plain causal attention (W = infinity) and ragged batches (ends clipped to each row's length);
- a drafter block that sees the W context positions before its anchor a: [a - W, a) for all of its
  queries (the block's own keys and the summary tokens are attended separately and merged by
  `merge_attention`, which is why the log-sum-exp is returned too).

A query whose range is empty gets zeros and a log-sum-exp of MASK_VALUE (finite, so merging never
meets inf - inf). Scores and softmax in float32; probabilities cast to the value dtype before the
value product, as in the model's XLA attention.

Only jax and numpy are imported, so a bare GPU machine can run this module.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.pallas_kernels.scores import STANDARD_SCORES, AttentionScores
from specjax.pallas_kernels.tree_attention.reference import MASK_VALUE


@dataclasses.dataclass(frozen=True)
class WindowAttentionDims:
    """Sizes of one windowed-attention call, read off (and checked against) its arguments."""

    batch: int
    """B: independent sequences."""
    num_queries: int
    """T: queries per sequence."""
    num_heads: int
    """H: query heads."""
    head_dim: int
    """D: width of one head."""
    num_keys: int
    """S: keys per sequence."""
    num_kv_heads: int
    """Kh: key/value heads; query head h reads kv head h // (H // Kh)."""

    @property
    def group_size(self) -> int:
        """G = H // Kh: query heads sharing one kv head."""
        return self.num_heads // self.num_kv_heads


def check_window_attention_shapes(q, k, v, starts, ends) -> WindowAttentionDims:
    """Validate the arguments of a windowed-attention call. Raises ValueError naming the offending one."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}, expected 4 dims [B, T, H, D]")
    batch, num_queries, num_heads, head_dim = q.shape
    if num_queries < 1:
        raise ValueError(f"q has shape {tuple(q.shape)}: T (axis 1) must be at least 1")
    if k.ndim != 4 or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [B, S, Kh, D] with B={batch}, D={head_dim} (from q)")
    _, num_keys, num_kv_heads, _ = k.shape
    if num_keys < 1:
        raise ValueError(f"k has shape {tuple(k.shape)}: S (axis 1) must be at least 1")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"k has Kh={num_kv_heads} kv heads, which must divide the H={num_heads} query heads of q")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}, expected the shape of k {tuple(k.shape)}")
    for name, array in (("starts", starts), ("ends", ends)):
        if array.shape != (batch, num_queries):
            raise ValueError(f"{name} has shape {tuple(array.shape)}, expected [B, T] = {(batch, num_queries)}")
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} has dtype {array.dtype}, expected an integer dtype")
    return WindowAttentionDims(batch, num_queries, num_heads, head_dim, num_keys, num_kv_heads)


def sliding_window_ranges(query_positions, window: int | None, kv_lengths=None):
    """Key ranges of causal (sliding-window) attention where key j sits at position j.

    query_positions: [B, T] int, the key index each query sits at; window: keys each query sees,
    itself included (HF's `sliding_window`: key j is visible iff p - W < j <= p), or None for plain
    causal attention; kv_lengths: optional [B], keys at or past it are hidden. Returns (starts, ends),
    each [B, T] int32.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    positions = query_positions.astype(jnp.int32)
    ends = positions + 1
    starts = jnp.zeros_like(positions) if window is None else jnp.maximum(positions - window + 1, 0)
    if kv_lengths is not None:
        ends = jnp.minimum(ends, kv_lengths.astype(jnp.int32)[:, None])
    return starts, ends


def window_attention_reference(q, k, v, starts, ends, scores: AttentionScores = STANDARD_SCORES):
    """Attention of each query over its key range. Returns (out [B, T, H, D] in q.dtype, lse [B, T, H]
    float32: the log-sum-exp of the query's visible logits, MASK_VALUE when it sees nothing).

    q: [B, T, H, D]; k, v: [B, S, Kh, D]; starts, ends: [B, T] int (query i sees keys starts..ends-1);
    scores: the logits' scale and optional soft cap. Differentiable in q, k and v.
    """
    dims = check_window_attention_shapes(q, k, v, starts, ends)
    key_index = jnp.arange(dims.num_keys, dtype=jnp.int32)  # [S]
    visible = (key_index >= starts[..., None]) & (key_index < ends[..., None])  # [B, T, S]
    return masked_attention(q, k, v, visible, scores)


def masked_attention(q, k, v, visible, scores: AttentionScores = STANDARD_SCORES):
    """Attention under an explicit mask, with its log-sum-exp: for small key sets (a block's own
    keys, summary tokens) that are merged with windowed attention by `merge_attention`.

    q: [B, T, H, D]; k, v: [B, S, Kh, D]; visible: [B, T, S] bool. Returns (out [B, T, H, D] in
    q.dtype, lse [B, T, H] float32), zeros and MASK_VALUE for a query that sees nothing.
    """
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    visible = visible[:, None, None]  # [B, 1, 1, T, S] against scores [B, Kh, G, T, S]
    grouped_q = q.reshape(batch, num_queries, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, T, Kh, G, D]
    products = jnp.einsum("BTKGD,BSKD->BKGTS", grouped_q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(visible, scores.logits(products, head_dim), MASK_VALUE)  # [B, Kh, G, T, S]
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)  # [B, Kh, G, T, 1]
    seen = total > 0
    probs = (weights / jnp.where(seen, total, 1.0)).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v, preferred_element_type=jnp.float32)  # [B, T, Kh, G, D]
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, total, 1.0)), MASK_VALUE)[..., 0]  # [B, Kh, G, T]
    out = out.reshape(batch, num_queries, num_heads, head_dim).astype(q.dtype)
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(batch, num_queries, num_heads)  # [B, T, H]
    return out, lse


def merge_attention(parts):
    """Combine attention over disjoint key sets into attention over their union.

    parts: sequence of (out [B, T, H, D], lse [B, T, H]) pairs, as `window_attention_reference` (or
    the kernel) returns them. Each part's output is reweighted by its share exp(lse_i - lse) of the
    total softmax mass. Returns (out [B, T, H, D], lse [B, T, H]); differentiable through both.
    """
    outs, lses = zip(*parts)
    stacked = jnp.stack(lses)  # [P, B, T, H]
    total = jax.nn.logsumexp(stacked, axis=0)  # [B, T, H]
    shares = jnp.exp(stacked - total)  # [P, B, T, H]
    out = sum(share[..., None] * o.astype(jnp.float32) for share, o in zip(shares, outs))
    return out.astype(outs[0].dtype), total
