"""RAPID drafting: the target drafts on a short retrieved context, and verifies with the full one.

Each row keeps a second target KV cache, the retrieval cache, that holds [retrieved chunks +
question + tokens generated so far] rather than the whole document. A step drafts `drafts` tokens
autoregressively on it (cheap attention: the context is short), then the target verifies them in one
pass over the full cache, and the accepted tokens go into both caches. With the standard acceptance
rule the output is the target's own (lossless); the drafts only decide how many tokens a step
commits.

Slot bookkeeping. `drafting_lengths` is the retrieval-cache slot of the row's `last_token`, which
is in neither cache yet (as `lengths` is for the full cache). A step's first draft pass writes two
tokens, the one before `last_token` and `last_token` itself: after a step that accepted every draft,
the last draft's K/V was never written (no pass ran on it), and otherwise the pass rewrites the
token already there with the same K/V. That keeps the step to `drafts` forward passes with no
host-side branch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError, check_at_least
from specjax.models.cache import KVCache
from specjax.models.config import TransformerConfig
from specjax.models.transformer import forward


@dataclasses.dataclass(frozen=True)
class RapidConfig:
    """How the rapid method drafts."""

    drafts: int = 4
    """Tokens the target drafts on its retrieved context per step (RAPID's public code uses 10;
    on a CPU, where each draft pass reads every weight, fewer pay better)."""
    eta: float = 0.0
    """Knowledge transfer (`verify.py:accept_transfer`): 0 keeps the output the target's own
    (lossless, the default). eta > 0 shifts the target toward the drafter's distribution where the
    drafter is confident, which can help a small target read a long context; the output is then no
    longer the target's, and stats label it lossy. Greedy rows follow the shifted distribution's
    argmax."""

    def __post_init__(self):
        check_at_least(1, drafts=self.drafts)
        if not self.eta >= 0:
            raise SpecjaxError(f"eta must be >= 0, got {self.eta}")

    def within_query_rows(self, query_rows: int | None) -> "RapidConfig":
        """This config for a target padded to query_rows = W rows: at most W - 1 drafts a step, so a
        verify pass has the AR steps' W rows (as a chain keeps to chain:W-1, slots.method_within_query_rows)."""
        if query_rows is None or self.drafts + 1 <= query_rows:
            return self
        return dataclasses.replace(self, drafts=query_rows - 1)

    @property
    def lossy(self) -> bool:
        return self.eta > 0

    @property
    def lossy_label(self) -> str | None:
        """What stats and responses say when the output is not the target's (None when it is)."""
        if not self.lossy:
            return None
        return f"rapid knowledge transfer at eta={self.eta:g}: the output follows the target shifted toward its drafts"


def draft_on_retrieved(params, config: TransformerConfig, cache: KVCache, slot, previous, last_token, draw_keys,
                       draw):
    """Draft len(draw_keys) tokens per row with the target on its retrieval cache.

    cache: the rows' retrieval caches; slot [S]: where last_token goes; previous [S]: the token at
    slot - 1 (rewritten, see the module docstring); draw_keys [K, S, 2]: one row key per draft;
    draw(logits [S, V], keys [S, 2]) -> (tokens [S], kept: a pytree of [S, ...] arrays, such as the
    processed logits the token was drawn from), the row's sampling rule. Returns (drafts [S, K], the
    kept pytree stacked to [S, K, ...], the updated cache). Writes K/V at slot - 1 .. slot + K - 1
    (the last draft's K/V is not written)."""
    rows = last_token.shape[0]
    # Drafts need no exactness (only the verify pass must match AR's shapes), so they run unpadded:
    # at 8k context in bf16 the 4 padded draft passes were 217 of rapid's 334 ms a step, and an
    # unpadded step costs about 0.8x a padded one (docs/notes/2026-12-06-retrieval-augmented-drafting.md,
    # "Retrieval-augmented drafting at 2k, 4k and 8k in bf16").
    config = dataclasses.replace(config, query_rows=None)
    first = forward(params, config, jnp.stack([previous, last_token], axis=1),  # [S, 2]
                    slot[:, None] + jnp.arange(-1, 1, dtype=jnp.int32), cache, slot - 1,
                    logit_positions=jnp.ones((rows, 1), jnp.int32))
    token, kept = draw(first.logits[:, 0], draw_keys[0])

    def one_draft(carry, key):
        cache, token, position = carry
        out = forward(params, config, token[:, None], position[:, None], cache, position)
        following, kept = draw(out.logits[:, 0], key)
        return (out.cache, following, position + 1), (following, kept)

    (cache, _, _), (rest, rest_kept) = jax.lax.scan(one_draft, (first.cache, token, slot + 1), draw_keys[1:])
    drafts = jnp.concatenate([token[:, None], rest.T], axis=1)  # [S, K]
    stacked = jax.tree.map(lambda a, b: jnp.concatenate([a[:, None], jnp.swapaxes(b, 0, 1)], axis=1), kept, rest_kept)
    return drafts, stacked, cache
