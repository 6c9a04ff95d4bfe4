"""Plain-jnp tree attention: the semantics the Pallas kernel must reproduce, and the "xla" implementation.

The T new tokens of a verification step (the nodes of a draft tree, a causal chain, or one decode token)
attend to the committed prefix of the KV cache and to each other:

- cache slot s of row b is visible iff s < prefix_lengths[b]; later slots may hold anything (stale
  entries, other rows' leftovers) and must not influence the result;
- among the new tokens, query i sees key j iff tree_mask[b, i, j].

This is the same computation as `specjax.models.layers.grouped_query_attention` over a cache whose new
tokens were written at slots prefix_lengths[b] .. prefix_lengths[b]+T-1 with `attention_mask(...,
block_mask=tree_mask)`, only with the cache and the new tokens passed separately, so a kernel can skip
the unused tail of the cache. The dtype handling is copied from there: scores in float32, softmax in
float32, probabilities cast to the value dtype before the value product. The one deliberate difference
is a query row that sees nothing at all: here it gives zeros, where the model's softmax over a fully
masked row would average every slot, garbage included. Real trees always let a node see itself, so the
two agree on every row that occurs in practice.

Only jax and numpy are imported, so a bare GPU machine can run this module.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.pallas_kernels.scores import MASK_VALUE, STANDARD_SCORES, AttentionScores


@dataclasses.dataclass(frozen=True)
class TreeAttentionDims:
    """Sizes of one tree-attention call, read off (and checked against) its arguments."""

    batch: int
    """B: independent sequences."""
    num_new: int
    """T: new tokens (tree nodes) per sequence; the queries."""
    num_heads: int
    """H: query heads."""
    head_dim: int
    """D: width of one head."""
    cache_length: int
    """S: slots in the KV cache, committed or not."""
    num_kv_heads: int
    """Kh: key/value heads; query head h reads kv head h // (H // Kh)."""

    @property
    def group_size(self) -> int:
        """G = H // Kh: query heads sharing one kv head."""
        return self.num_heads // self.num_kv_heads


def check_tree_attention_shapes(q, cache_k, cache_v, prefix_lengths, tree_k, tree_v, tree_mask) -> TreeAttentionDims:
    """Validate the arguments of a tree-attention call. Raises ValueError naming the offending argument."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}, expected 4 dims [B, T, H, D]")
    batch, num_new, num_heads, head_dim = q.shape
    if num_new < 1:
        raise ValueError(f"q has shape {tuple(q.shape)}: T (axis 1) must be at least 1")
    if cache_k.ndim != 4 or cache_k.shape[0] != batch or cache_k.shape[3] != head_dim:
        raise ValueError(
            f"cache_k has shape {tuple(cache_k.shape)}, expected [B, S, Kh, D] with B={batch}, D={head_dim} (from q)"
        )
    _, cache_length, num_kv_heads, _ = cache_k.shape
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"cache_k has Kh={num_kv_heads} kv heads, which must divide the H={num_heads} query heads of q"
        )
    if cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_v has shape {tuple(cache_v.shape)}, expected the shape of cache_k {tuple(cache_k.shape)}")
    if prefix_lengths.shape != (batch,):
        raise ValueError(f"prefix_lengths has shape {tuple(prefix_lengths.shape)}, expected [B] = ({batch},)")
    if not jnp.issubdtype(prefix_lengths.dtype, jnp.integer):
        raise ValueError(f"prefix_lengths has dtype {prefix_lengths.dtype}, expected an integer dtype")
    expected_tree = (batch, num_new, num_kv_heads, head_dim)
    for name, array in (("tree_k", tree_k), ("tree_v", tree_v)):
        if array.shape != expected_tree:
            raise ValueError(f"{name} has shape {tuple(array.shape)}, expected [B, T, Kh, D] = {expected_tree}")
    if tree_mask.shape != (batch, num_new, num_new):
        raise ValueError(
            f"tree_mask has shape {tuple(tree_mask.shape)}, expected [B, T, T] = {(batch, num_new, num_new)}"
        )
    if tree_mask.dtype != jnp.bool_:
        raise ValueError(f"tree_mask has dtype {tree_mask.dtype}, expected bool")
    return TreeAttentionDims(batch, num_new, num_heads, head_dim, cache_length, num_kv_heads)


def tree_attention_reference(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    prefix_lengths: jax.Array,
    tree_k: jax.Array,
    tree_v: jax.Array,
    tree_mask: jax.Array,
    scores: AttentionScores = STANDARD_SCORES,
) -> jax.Array:
    """Attention of T new tokens over a committed cache prefix plus themselves. Returns [B, T, H, D] in q.dtype.

    q: [B, T, H, D]; cache_k, cache_v: [B, S, Kh, D]; prefix_lengths: [B] int (slots < prefix_lengths[b]
    are visible to row b); tree_k, tree_v: [B, T, Kh, D]; tree_mask: [B, T, T] bool (query x key);
    scores: the logits' scale and optional soft cap.
    """
    dims = check_tree_attention_shapes(q, cache_k, cache_v, prefix_lengths, tree_k, tree_v, tree_mask)
    batch, num_new, cache_length = dims.batch, dims.num_new, dims.cache_length

    keys = jnp.concatenate([cache_k, tree_k], axis=1)  # [B, S+T, Kh, D]
    values = jnp.concatenate([cache_v, tree_v], axis=1)  # [B, S+T, Kh, D]
    committed = jnp.arange(cache_length, dtype=jnp.int32)[None, :] < prefix_lengths[:, None]  # [B, S]
    visible = jnp.concatenate(
        [jnp.broadcast_to(committed[:, None, :], (batch, num_new, cache_length)), tree_mask], axis=2
    )  # [B, T, S+T]
    visible = visible[:, None, None, :, :]  # [B, 1, 1, T, S+T] against scores [B, Kh, G, T, S+T]

    grouped_q = q.reshape(batch, num_new, dims.num_kv_heads, dims.group_size, dims.head_dim)  # [B, T, Kh, G, D]
    products = jnp.einsum("BTKGD,BSKD->BKGTS", grouped_q, keys, preferred_element_type=jnp.float32)
    logits = scores.logits(products, dims.head_dim)  # [B, Kh, G, T, S+T]
    # Replacing (not adding to) hidden scores also discards any inf/NaN that garbage keys produced.
    logits = jnp.where(visible, logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    # A no-op wherever a row sees at least one key (exp(MASK_VALUE - max) underflows to exactly 0);
    # for a row that sees nothing it turns the uniform average over garbage into zeros.
    probs = jnp.where(visible, probs, 0.0).astype(values.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, values, preferred_element_type=jnp.float32)  # [B, T, Kh, G, D]
    return out.reshape(batch, num_new, dims.num_heads, dims.head_dim).astype(q.dtype)  # [B, T, H, D]
