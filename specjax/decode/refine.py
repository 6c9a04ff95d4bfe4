"""Parallel (Jacobi) refinement of a drafted block, inside the jitted decode loop.

Pass r refines every draft slot at once from the previous pass's draft x^{r-1}:
    logits^r_k = drafter_logits_k + refiner(h, x^{r-1}_{<k})_k,    x^r_k = choose(logits^r_k)
Slot k depends only on drafts to its left, so after r passes slots 1..r agree with the refiner's
own left-to-right chain, and a pass that changes nothing has reached that chain everywhere.

Exactness when sampling: x^r_k is a Gumbel-max draw from q^r_k = softmax(processed(logits^r_k))
with noise g_k that is drawn once per block and reused by every pass. x^{r-1}_{<k} depends only on
the drafter's draft and g_{<k}, never on g_k, so the final x_k is an exact sample from the final
q_k, which is what verification uses. Stopping early when a pass changes nothing gives the same
result as running every pass (the draft is a fixed point), so adaptive stopping keeps this.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from specjax.decode.sampling import SamplingConfig, processed_logits
from specjax.errors import SpecjaxError
from specjax.models.refiner import RefinerConfig, draft_confidence, refiner_corrections


@dataclasses.dataclass(frozen=True)
class RefineConfig:
    """How many refinement passes a block gets. Hashable: a static argument of the decode loop."""

    max_passes: int = 1
    """Upper bound on passes per block (0 turns refinement off). One pass measured best for the
    SmolLM2 refiner on CPU (docs/notes/2026-12-02-refiner-design.md): more passes raised tau by under 1% for 2-4x the
    refinement time."""
    adaptive: bool = True
    """Stop as soon as a pass changes no draft token in any row."""
    keep_confident: float = 0.0
    """If > 0, slots where the drafter's top probability is at least this keep the drafter's own
    logits (0 = refine every slot). Exactness is unaffected: the choice depends only on the
    drafter's output for the block."""
    slots: int = 0
    """Refine only the first this many draft slots (0: all of them). The refiner's mixer is causal,
    so these slots get exactly the corrections a pass over the whole block gives them; later slots
    keep the drafter's logits, and the pass runs the mixer and the vocabulary-wide correction over
    fewer slots. Exactness is unaffected: a slot left alone is drawn from the drafter's own q."""

    def __post_init__(self):
        if self.max_passes < 0:
            raise SpecjaxError(f"refine passes must be >= 0, got {self.max_passes}")
        if not 0.0 <= self.keep_confident <= 1.0:
            raise SpecjaxError(f"keep_confident must be in [0, 1], got {self.keep_confident}")
        if self.slots < 0:
            raise SpecjaxError(f"refine slots must be >= 0 (0: every slot), got {self.slots}")


def refine_drafts(refiner_params, refiner_config: RefinerConfig, refine: RefineConfig, hidden, drafter_logits,
                  anchor_embed, draft_index, embed_index: Callable[[jax.Array], jax.Array], low_rank_head,
                  sampling: SamplingConfig, rng, choose: Callable[[jax.Array], jax.Array] | None = None):
    """Refine a block draft.

    hidden: [B, K, d] drafter states of draft slots 1..K; drafter_logits: [B, K, V']; anchor_embed:
    [B, d] embedding of the block's first (committed) token; draft_index: [B, K] the drafter's draft
    as head-vocabulary indices; embed_index maps such indices to embeddings [.., d]; low_rank_head:
    [rank, V'] (see Refiner.low_rank_head). Returns (draft_index [B, K], logits [B, K, V'], passes []).
    choose, if given, replaces the choice from `sampling` and `rng`: logits [B, K, V'] -> [B, K]
    indices. It must keep the property above (slot k's noise drawn once per block, never from
    drafts); the slot step gives it per-row temperatures and keys.
    """
    if choose is None and sampling.greedy:
        choose = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    elif choose is None:
        noise = jax.random.gumbel(rng, drafter_logits.shape)  # [B, K, V'], shared by every pass
        choose = lambda logits: jnp.argmax(processed_logits(logits, sampling) + noise, axis=-1).astype(jnp.int32)

    num_slots = drafter_logits.shape[1]
    refined_slots = min(refine.slots or num_slots, num_slots)  # R
    confidence = draft_confidence(drafter_logits[:, :refined_slots])  # [B, R, 2], the same for every pass
    if refine.keep_confident > 0:
        refine_slot = confidence[..., :1] < jnp.log(refine.keep_confident)  # [B, R, 1]
    else:
        refine_slot = jnp.ones(confidence.shape[:-1] + (1,), bool)

    def one_pass(draft):
        previous = jnp.concatenate([anchor_embed[:, None, :], embed_index(draft[:, : refined_slots - 1])],
                                   axis=1)  # [B, R, d]
        correction = refiner_corrections(refiner_params, refiner_config, hidden[:, :refined_slots], previous,
                                         confidence, low_rank_head)  # [B, R, V']
        refined = drafter_logits[:, :refined_slots] + jnp.where(refine_slot, correction, 0.0)
        return jnp.concatenate([refined, drafter_logits[:, refined_slots:].astype(refined.dtype)], axis=1)  # [B, K, V']

    def keep_going(carry):
        passes, _, _, changed = carry
        return (passes < refine.max_passes) & changed

    def body(carry):
        passes, draft, _, _ = carry
        logits = one_pass(draft)
        new_draft = choose(logits)
        changed = jnp.any(new_draft != draft) | (not refine.adaptive)
        return passes + 1, new_draft, logits, changed

    init = (jnp.int32(0), draft_index, drafter_logits.astype(jnp.float32), jnp.bool_(True))
    passes, draft, logits, _ = jax.lax.while_loop(keep_going, body, init)
    return draft, logits, passes
