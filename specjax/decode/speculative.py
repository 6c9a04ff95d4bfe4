"""Chain speculative decoding with a block-diffusion drafter, as one jitted `lax.while_loop`.

Each iteration: draft a block in one drafter pass -> verify [last, d_1..d_K] in one target pass ->
accept n drafts plus one bonus/correction token per row -> advance each row's cache length by n+1.
Rejected entries stay in the target cache and the drafter's context cache past the row's length,
where attention never reads and the next step overwrites them; nothing goes back to the host.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decode.autoregressive import prefill
from specjax.decode.refine import RefineConfig, refine_drafts
from specjax.decode.sampling import SamplingConfig, processed_logits, sample, target_probs
from specjax.decode.verify import accept_greedy, accept_sampled
from specjax.errors import SpecjaxError
from specjax.models.cache import KVCache, write_rows
from specjax.models.config import TransformerConfig
from specjax.decode.context import DrafterContext, append_context, context_key_sets, prefill_context
from specjax.models.drafter import Drafter, DrafterConfig
from specjax.models.layers import attention_mask
from specjax.models.refiner import RefinerConfig, refiner_low_rank_head
from specjax.models.transformer import apply_head, embed_tokens, forward, head_matrix, token_embedder


@struct.dataclass
class ChainState:
    """What the speculative loop carries between verify steps."""

    step: jax.Array
    """[] int32: verify steps done."""
    tokens: jax.Array
    """[B, N + block] int32: committed generated tokens (slack of one block for the last write)."""
    num_generated: jax.Array
    """[B] int32: committed generated tokens per row, capped at N."""
    last_token: jax.Array
    """[B] int32: newest committed token, not yet in either cache."""
    lengths: jax.Array
    """[B] int32: tokens in the target cache == entries in the drafter's context cache."""
    done: jax.Array
    """[B] bool."""
    target_cache: KVCache
    context_cache: DrafterContext
    """Drafter context: K/V per committed token, or the bounded windowed state (decode/context.py)."""
    rng: jax.Array
    accepted_histogram: jax.Array
    """[B, block] int32: verify steps that accepted n drafts, n = 0..block-1."""
    refine_passes: jax.Array
    """[] int32: refinement passes run, summed over verify steps."""


def draft_block_states(target_params, target_config: TransformerConfig, drafter_params, drafter_config: DrafterConfig,
                       last_token, lengths, context_cache: KVCache, known=None, known_tokens=None, context_from=None):
    """One drafter pass. known/known_tokens: [B, K] slots already unmasked by earlier denoising passes
    (default: none). context_from: [B] int32, a full-attention drafter reads only the context
    positions from there on (a row windowed under memory pressure; None: all of them). Returns the
    drafter's final states [B, K, d] of draft slots 1..K (positions lengths+1 .. lengths+K,
    K = block-1), ready for the LM head."""
    batch, block = last_token.shape[0], drafter_config.block_size
    slot = jnp.arange(block, dtype=jnp.int32)
    if known is None:
        known = jnp.zeros((batch, block - 1), bool)
        known_tokens = jnp.zeros((batch, block - 1), jnp.int32)
    is_mask = jnp.concatenate([jnp.zeros((batch, 1), bool), ~known], axis=1)  # [B, Bk]
    fill = drafter_config.mask_token_id if drafter_config.mask_token_id is not None else 0
    block_tokens = jnp.concatenate([last_token[:, None], jnp.where(known, known_tokens, fill)], axis=1)  # [B, Bk]
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
                last_token, lengths, context_cache: KVCache, head, known=None, known_tokens=None):
    """One drafter pass through the head: draft logits [B, K, V'] for draft slots 1..K. head: [d, V']
    output matrix (the target's LM head, or its draft-vocabulary columns)."""
    h = draft_block_states(target_params, target_config, drafter_params, drafter_config, last_token, lengths,
                           context_cache, known, known_tokens)
    return apply_head(h, head)


@struct.dataclass
class RefinerInputs:
    """A refiner and what it needs per decode call, for draft_chain."""

    params: dict
    low_rank_head: jax.Array
    """[rank, V'] the refiner's projection of the head, computed once per call."""
    config: RefinerConfig = struct.field(pytree_node=False)
    refine: RefineConfig = struct.field(pytree_node=False)


def draft_chain(target_params, target_config: TransformerConfig, drafter_params, drafter_config: DrafterConfig,
                last_token, lengths, context_cache: KVCache, head, draft_vocab, sampling: SamplingConfig, rng,
                denoise_steps: int, refiner: RefinerInputs | None = None):
    """Draft K tokens with `denoise_steps` drafter passes, then refine them when a refiner is given.
    Returns (draft [B, K] token ids, q [B, K, V] draft distributions over the full vocabulary or None
    when greedy, refinement passes run []).

    Each pass unmasks about K/steps more slots, which later passes see as tokens. Greedy drafting
    unmasks the most confident slots first. Sampled drafting unmasks left to right: the acceptance
    test needs each q_k to depend only on drafts to its left, otherwise accepting d_k would bias
    the later drafts it was conditioned on and the output would no longer follow the target.
    """
    if refiner is not None:
        return _draft_and_refine(target_params, target_config, drafter_params, drafter_config, last_token, lengths,
                                 context_cache, head, draft_vocab, sampling, rng, refiner)
    batch, num_draft = last_token.shape[0], drafter_config.block_size - 1
    known = jnp.zeros((batch, num_draft), bool)
    draft_index = jnp.zeros((batch, num_draft), jnp.int32)  # index into the head's vocabulary
    q = None
    for step in range(denoise_steps):
        to_token = (lambda i: i) if draft_vocab is None else (lambda i: jnp.take(draft_vocab, i))
        logits = draft_block(target_params, target_config, drafter_params, drafter_config, last_token, lengths,
                             context_cache, head, known, to_token(draft_index))  # [B, K, V']
        remaining = num_draft - step * (num_draft // denoise_steps)
        take = remaining if step == denoise_steps - 1 else num_draft // denoise_steps
        if sampling.greedy:
            candidate = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            confidence = jnp.where(known, -jnp.inf, jnp.max(jax.nn.log_softmax(logits), axis=-1))
        else:
            q_logits = processed_logits(logits, sampling)
            candidate = jax.random.categorical(jax.random.fold_in(rng, step), q_logits, axis=-1).astype(jnp.int32)
            probs = jax.nn.softmax(q_logits, axis=-1)
            confidence = jnp.where(known, -jnp.inf, -jnp.arange(num_draft, dtype=jnp.float32))  # leftmost first
        rank = jnp.argsort(jnp.argsort(-confidence, axis=-1), axis=-1)  # 0 = unmask first
        newly = (~known) & (rank < take)
        draft_index = jnp.where(newly, candidate, draft_index)
        if not sampling.greedy:
            q = probs if q is None else jnp.where(newly[..., None], probs, q)
        known = known | newly
    return _to_full_vocabulary(draft_index, q, draft_vocab, target_config.vocab_size) + (jnp.int32(0),)


def _to_full_vocabulary(draft_index, q, draft_vocab, vocab_size: int):
    """Head-vocabulary indices and distributions -> token ids and [.., V] distributions (q is 0 off
    the draft vocabulary)."""
    draft = draft_index if draft_vocab is None else jnp.take(draft_vocab, draft_index)
    if q is not None and draft_vocab is not None:
        q = jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., draft_vocab].set(q)
    return draft, q


def _draft_and_refine(target_params, target_config: TransformerConfig, drafter_params, drafter_config: DrafterConfig,
                      last_token, lengths, context_cache: KVCache, head, draft_vocab, sampling: SamplingConfig, rng,
                      refiner: RefinerInputs):
    """One drafter pass, then Jacobi refinement (decode/refine.py); q is the refined distribution."""
    draft_rng, refine_rng = jax.random.split(rng)
    hidden = draft_block_states(target_params, target_config, drafter_params, drafter_config, last_token, lengths,
                                context_cache)  # [B, K, d]
    logits = apply_head(hidden, head)  # [B, K, V']
    if sampling.greedy:
        draft_index = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        draft_index = jax.random.categorical(draft_rng, processed_logits(logits, sampling), axis=-1).astype(jnp.int32)
    to_token = (lambda i: i) if draft_vocab is None else (lambda i: jnp.take(draft_vocab, i))
    embed = token_embedder(target_params, target_config)  # one table cast for every pass (see token_embedder)
    embed_index = lambda i: embed(to_token(i))
    anchor_embed = embed(last_token)  # [B, d]
    draft_index, logits, passes = refine_drafts(refiner.params, refiner.config, refiner.refine, hidden, logits,
                                                anchor_embed, draft_index, embed_index, refiner.low_rank_head,
                                                sampling, refine_rng)
    q = None if sampling.greedy else jax.nn.softmax(processed_logits(logits, sampling), axis=-1)
    return _to_full_vocabulary(draft_index, q, draft_vocab, target_config.vocab_size) + (passes,)


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


_STATIC = ("target_config", "drafter_config", "sampling", "max_new_tokens", "eos_token_ids", "cache_length",
           "denoise_steps", "refiner_config", "refine")


@partial(jax.jit, static_argnames=_STATIC)
def generate_chain(target_params, drafter_params, draft_vocab, prompt_tokens, prompt_lengths, rng, refiner_params=None,
                   *, target_config: TransformerConfig, drafter_config: DrafterConfig, sampling: SamplingConfig,
                   max_new_tokens: int, eos_token_ids: tuple[int, ...], cache_length: int, denoise_steps: int = 1,
                   refiner_config: RefinerConfig | None = None, refine: RefineConfig = RefineConfig()):
    """Speculative generation. Returns (tokens [B, N], num_generated [B], accepted_histogram [B, block],
    refine_passes [] summed over verify steps).

    draft_vocab: None, or [V'] token ids the drafter may propose (a smaller head is cheaper; tokens
    outside it get draft probability 0, which the acceptance rules handle exactly).
    cache_length must hold prompt + max_new_tokens + block slots. denoise_steps > 1 drafts with
    several drafter passes per block (see draft_chain); 1 is DFlash's single pass. With
    refiner_params and refiner_config, every block is refined (decode/refine.py) before verification.
    """
    if (refiner_params is None) != (refiner_config is None):
        raise SpecjaxError("give both refiner_params and refiner_config, or neither")
    if refiner_config is not None and denoise_steps != 1:
        raise SpecjaxError("the refiner works on single-pass drafts; use denoise_steps=1 with it")
    batch = prompt_tokens.shape[0]
    block = drafter_config.block_size
    target_config.check_ring_step(block, "chain verification")
    taps = drafter_config.target_layer_ids
    eos = jnp.asarray(eos_token_ids or (-1,), jnp.int32)
    rng, first_rng = jax.random.split(rng)
    first, target_cache, context_cache = start_speculation(target_params, target_config, drafter_params, drafter_config,
                                                           prompt_tokens, prompt_lengths, cache_length, sampling,
                                                           first_rng)
    head = head_matrix(target_params, target_config, draft_vocab)  # [d, V'], gathered once, outside the loop
    refiner = None
    if refiner_config is not None:
        refiner = RefinerInputs(refiner_params, refiner_low_rank_head(refiner_params, refiner_config, head),
                                refiner_config, refine)
    state = ChainState(
        step=jnp.int32(0),
        tokens=jnp.zeros((batch, max_new_tokens + block), jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((batch,), jnp.int32),
        last_token=first,
        lengths=prompt_lengths.astype(jnp.int32),
        done=jnp.isin(first, eos) | (max_new_tokens <= 1),
        target_cache=target_cache,
        context_cache=context_cache,
        rng=rng,
        accepted_histogram=jnp.zeros((batch, block), jnp.int32),
        refine_passes=jnp.int32(0),
    )

    def keep_going(s: ChainState):
        return ~jnp.all(s.done)

    def one_step(s: ChainState):
        rng, draft_rng, accept_rng = jax.random.split(s.rng, 3)
        draft, q, passes = draft_chain(target_params, target_config, drafter_params, drafter_config, s.last_token,
                                       s.lengths, s.context_cache, head, draft_vocab, sampling, draft_rng,
                                       denoise_steps, refiner)  # [B, K], [B, K, V] or None, []

        verify_tokens = jnp.concatenate([s.last_token[:, None], draft], axis=1)  # [B, Bk]
        verify_positions = s.lengths[:, None] + jnp.arange(block, dtype=jnp.int32)
        out = forward(target_params, target_config, verify_tokens, verify_positions, s.target_cache, s.lengths,
                      hidden_layers=taps)  # logits [B, Bk, V], hidden [B, Bk, taps, d]
        if sampling.greedy:
            n, next_token = accept_greedy(draft, out.logits)
        else:
            n, next_token = accept_sampled(draft, q, target_probs(out.logits, sampling), accept_rng)

        tokens, num_generated, done, advance = commit_tokens(s.tokens, s.num_generated, s.done, draft, n, next_token,
                                                             eos, max_new_tokens)
        live = ~s.done
        slot = jnp.arange(block, dtype=jnp.int32)[None, :]
        context_cache = append_context(drafter_params, drafter_config, s.context_cache, out.hidden,
                                       verify_positions, s.lengths, s.lengths + advance)
        histogram = s.accepted_histogram + live[:, None] * (slot == n[:, None])
        return ChainState(
            step=s.step + 1,
            tokens=tokens,
            num_generated=num_generated,
            last_token=next_token,
            lengths=s.lengths + advance,
            done=done,
            target_cache=out.cache,
            context_cache=context_cache,
            rng=rng,
            accepted_histogram=histogram,
            refine_passes=s.refine_passes + passes,
        )

    final = jax.lax.while_loop(keep_going, one_step, state)
    return final.tokens[:, :max_new_tokens], final.num_generated, final.accepted_histogram, final.refine_passes
