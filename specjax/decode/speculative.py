"""The block-diffusion drafter's pass and what a speculative step shares (decode/slots.py runs the step).

One drafter pass drafts a whole block: the anchor token and K mask slots in, K draft logits out
(DFlash's single pass; several denoising passes measured lower tau at a higher cost and were
removed). A verify step commits n accepted drafts plus one bonus/correction token per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decode.autoregressive import prefill
from specjax.decode.refine import RefineConfig
from specjax.decode.sampling import SamplingConfig, sample
from specjax.models.cache import KVCache, write_rows
from specjax.models.config import TransformerConfig
from specjax.decode.context import context_key_sets, prefill_context
from specjax.models.drafter import Drafter, DrafterConfig
from specjax.models.layers import attention_mask
from specjax.models.refiner import RefinerConfig
from specjax.models.transformer import apply_head, embed_tokens


def draft_block_states(target_params, target_config: TransformerConfig, drafter_params, drafter_config: DrafterConfig,
                       last_token, lengths, context_cache: KVCache, context_from=None):
    """One drafter pass: the anchor token, then K mask slots. context_from: [B] int32, a full-attention drafter reads only the context
    positions from there on (a row windowed under memory pressure; None: all of them). Returns the
    drafter's final states [B, K, d] of draft slots 1..K (positions lengths+1 .. lengths+K,
    K = block-1), ready for the LM head."""
    batch, block = last_token.shape[0], drafter_config.block_size
    slot = jnp.arange(block, dtype=jnp.int32)
    is_mask = slot[None, :].repeat(batch, 0) > 0  # [B, Bk]
    fill = drafter_config.mask_token_id if drafter_config.mask_token_id is not None else 0
    block_tokens = jnp.concatenate([last_token[:, None], jnp.full((batch, block - 1), fill, jnp.int32)],
                                   axis=1)  # [B, Bk]
    positions = lengths[:, None] + slot  # [B, Bk]
    drafter = Drafter(drafter_config)
    x = drafter.apply({"params": drafter_params}, embed_tokens(target_params, target_config, block_tokens), is_mask,
                      method=Drafter.block_inputs)
    if drafter_config.window is not None:
        h = drafter.apply({"params": drafter_params}, x, positions,
                          context_key_sets(drafter_config, context_cache, lengths, block),
                          jnp.ones((batch, block, block), bool), method=Drafter.windowed)  # [B, Bk, d]
        return h[:, 1:]
    mask = attention_mask(lengths, block, context_cache.max_length, jnp.ones((batch, block, block), bool))
    if context_from is not None:
        mask &= (jnp.arange(context_cache.max_length, dtype=jnp.int32)[None, :] >= context_from[:, None])[:, None, :]
    h = drafter.apply({"params": drafter_params}, x, positions, context_cache.keys, context_cache.values, mask,
                      lengths)  # [B, Bk, d]
    return h[:, 1:]


def draft_block(target_params, target_config: TransformerConfig, drafter_params, drafter_config: DrafterConfig,
                last_token, lengths, context_cache: KVCache, head):
    """One drafter pass through the head: draft logits [B, K, V'] for draft slots 1..K. head: [d, V']
    output matrix (the target's LM head, or its draft-vocabulary columns)."""
    h = draft_block_states(target_params, target_config, drafter_params, drafter_config, last_token, lengths,
                           context_cache)
    return apply_head(h, head)


@struct.dataclass
class RefinerInputs:
    """A refiner and what it needs per decode call, for draft_chain."""

    params: dict
    low_rank_head: jax.Array
    """[rank, V'] the refiner's projection of the head, computed once per call."""
    config: RefinerConfig = struct.field(pytree_node=False)
    refine: RefineConfig = struct.field(pytree_node=False)


def to_full_vocabulary(draft_index, q, draft_vocab, vocab_size: int):
    """Head-vocabulary indices and distributions -> token ids and [.., V] distributions (q is 0 off
    the draft vocabulary)."""
    draft = draft_index if draft_vocab is None else jnp.take(draft_vocab, draft_index)
    if q is not None and draft_vocab is not None:
        q = jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., draft_vocab].set(q)
    return draft, q


def start_speculation(target_params, target_config: TransformerConfig, drafter_params, drafter_config: DrafterConfig,
                      prompt_tokens, prompt_lengths, cache_length: int, sampling: SamplingConfig, rng):
    """Prefill the target, fill the drafter's context cache with the prompt's features, and sample
    the first token. Returns (first [B], target_cache, context_cache)."""
    batch, prompt_len = prompt_tokens.shape
    logits, target_cache, features = prefill(target_params, target_config, prompt_tokens, prompt_lengths,
                                             cache_length, hidden_layers=drafter_config.target_layer_ids)
    context_cache = prefill_context(drafter_params, drafter_config, batch, cache_length, features, prompt_lengths)
    return sample(logits, rng, sampling), target_cache, context_cache


def commit_tokens(tokens, num_generated, done, accepted_drafts, n, next_token, eos, max_new_tokens: int):
    """Write one verify step's tokens: d_1..d_n then next_token (n+1 tokens) at num_generated.

    tokens: [B, N + slack]; accepted_drafts: [B, K] (only the first n count); n, next_token: [B].
    Rows that are done stay as they are; a row is done after EOS or N tokens. Returns (tokens,
    num_generated, done, advance [B]: how far the row's cache length moves)."""
    num_draft = accepted_drafts.shape[1]
    slot = jnp.arange(num_draft + 1, dtype=jnp.int32)[None, :]
    pad = jnp.zeros((accepted_drafts.shape[0], 1), accepted_drafts.dtype)  # K may be 0 (one AR token)
    shifted = jnp.concatenate([accepted_drafts, pad], axis=1)  # [B, K+1]
    new_tokens = jnp.where(slot < n[:, None], shifted, next_token[:, None])
    is_eos = jnp.isin(new_tokens, eos) & (slot <= n[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), num_draft + 1)
    committed = jnp.minimum(n + 1, first_eos + 1)
    live = ~done
    tokens = jnp.where(live[:, None], write_rows(tokens, new_tokens, num_generated), tokens)
    num_generated = jnp.minimum(num_generated + committed * live, max_new_tokens)
    done = done | (live & (first_eos <= num_draft)) | (num_generated >= max_new_tokens)
    return tokens, num_generated, done, (n + 1) * live
