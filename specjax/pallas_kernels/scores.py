"""How raw query-key products become attention logits, shared by the kernels, their references and
the model's XLA attention, so every path computes the same function.

Most models scale q.k by head_dim ** -0.5. Gemma 2 and 3 scale by query_pre_attn_scalar ** -0.5
instead, and Gemma 2 also soft-caps the scaled score, softcap * tanh(score / softcap), before the
mask and the softmax. The cap is applied inside the kernels' key loops (never on a dense score
matrix), and the windowed kernel's backward multiplies by its derivative, 1 - tanh^2.

Only jax is imported, so a bare GPU machine can run this module.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

# The logit of a masked key, one value for the model's XLA attention, the kernels and their references.
# Finite, so masked scores never produce inf - inf = NaN in the softmax, and a fully masked row gives a
# uniform softmax over garbage instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class AttentionScores:
    """The map from q.k to an attention logit. Hashable, so it is a static argument of the kernels."""

    scale: float | None = None
    """Multiplier of q.k; None means head_dim ** -0.5."""
    softcap: float | None = None
    """If set, the scaled score s becomes softcap * tanh(s / softcap), bounding it to (-softcap, softcap)."""

    def __post_init__(self):
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"AttentionScores.scale must be positive, got {self.scale}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"AttentionScores.softcap must be positive, got {self.softcap}")

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else float(self.scale)

    def logits(self, products, head_dim: int):
        """q.k products (float32, any shape) -> the logits the softmax sees."""
        scaled = products * self.scale_for(head_dim)
        if self.softcap is None:
            return scaled
        return self.softcap * jnp.tanh(scaled / self.softcap)

    def capped_gradient(self, logits):
        """d logit / d scaled score at these logits: 1 - (logit / softcap)^2, or 1 without a cap."""
        if self.softcap is None:
            return 1.0
        ratio = logits / self.softcap
        return 1.0 - ratio * ratio


STANDARD_SCORES = AttentionScores()
