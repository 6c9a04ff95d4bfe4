"""Windowed attention (each query sees one contiguous key range): a jnp reference and Pallas kernels
with a custom VJP.

`window_attention_op` is the entry point for model code: it picks the implementation by name, so a
config can switch between XLA's dense masked attention and the kernels without touching the call
site. `merge_attention` combines attention over disjoint key sets (a window, a block's own keys,
summary tokens) from their log-sum-exps.
"""

from __future__ import annotations

import jax

from specjax.pallas_kernels.scores import STANDARD_SCORES, AttentionScores
from specjax.pallas_kernels.window_attention.kernel import BlockSizes, window_attention
from specjax.pallas_kernels.window_attention.reference import (
    WindowAttentionDims,
    check_window_attention_shapes,
    masked_attention,
    merge_attention,
    sliding_window_ranges,
    window_attention_reference,
)

IMPLEMENTATIONS = ("xla", "pallas")

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionScores",
    "BlockSizes",
    "WindowAttentionDims",
    "check_window_attention_shapes",
    "masked_attention",
    "merge_attention",
    "sliding_window_ranges",
    "window_attention",
    "window_attention_op",
    "window_attention_reference",
]


def window_attention_op(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array, ends: jax.Array, *,
                        implementation: str = "xla", interpret: bool | None = None,
                        block_sizes: BlockSizes | None = None, scores: AttentionScores = STANDARD_SCORES):
    """Windowed attention by the named implementation: "xla" (plain jnp) or "pallas" (the kernels).

    Arguments and results as in `window_attention_reference`: (out [B, T, H, D], lse [B, T, H]).
    scores: the logits' scale and optional soft cap. interpret and block_sizes only apply to
    "pallas" (see `window_attention`).
    """
    if implementation == "xla":
        return window_attention_reference(q, k, v, starts, ends, scores)
    if implementation == "pallas":
        return window_attention(q, k, v, starts, ends,
                                block_sizes=BlockSizes() if block_sizes is None else block_sizes,
                                scores=scores, interpret=interpret)
    raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
