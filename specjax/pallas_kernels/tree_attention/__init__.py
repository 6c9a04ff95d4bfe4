"""Tree attention (new tokens over a ragged cache prefix plus a tree mask): a jnp reference and a Pallas kernel.

`tree_attention_op` is the entry point for model code: it picks the implementation by name, so a model
config can switch between XLA's dense attention and the kernel without touching the call site.
"""

from __future__ import annotations

import jax

from specjax.pallas_kernels.scores import STANDARD_SCORES, AttentionScores
from specjax.pallas_kernels.tree_attention.kernel import BlockSizes, tree_attention
from specjax.pallas_kernels.tree_attention.reference import (
    MASK_VALUE,
    TreeAttentionDims,
    check_tree_attention_shapes,
    tree_attention_reference,
)

IMPLEMENTATIONS = ("xla", "pallas")

__all__ = [
    "IMPLEMENTATIONS",
    "MASK_VALUE",
    "AttentionScores",
    "BlockSizes",
    "TreeAttentionDims",
    "check_tree_attention_shapes",
    "tree_attention",
    "tree_attention_op",
    "tree_attention_reference",
]


def tree_attention_op(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    prefix_lengths: jax.Array,
    tree_k: jax.Array,
    tree_v: jax.Array,
    tree_mask: jax.Array,
    *,
    implementation: str = "xla",
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    scores: AttentionScores = STANDARD_SCORES,
) -> jax.Array:
    """Tree attention by the named implementation: "xla" (plain jnp) or "pallas" (the kernel).

    Arguments and result as in `tree_attention_reference`. interpret and block_sizes only apply to
    "pallas" (see `tree_attention`); block_sizes=None means the kernel's defaults.
    """
    if implementation == "xla":
        return tree_attention_reference(q, cache_k, cache_v, prefix_lengths, tree_k, tree_v, tree_mask, scores)
    if implementation == "pallas":
        return tree_attention(
            q, cache_k, cache_v, prefix_lengths, tree_k, tree_v, tree_mask,
            block_sizes=BlockSizes() if block_sizes is None else block_sizes,
            scores=scores,
            interpret=interpret,
        )
    raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
