"""The prefill every method starts with, and a bare AR loop (`start_autoregressive` /
`continue_autoregressive`) kept for experiments/ring_decode_bench.py, which compares KV layouts the
Engine does not expose. Decoding itself runs on the slot step (decode/slots.py)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decode.sampling import SamplingConfig, sample
from specjax.models.cache import KVCache
from specjax.models.config import TransformerConfig
from specjax.models.transformer import forward


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries from one step to the next."""

    step: jax.Array
    """[] int32: loop iterations done (tokens generated per live row, after the prefill token)."""
    tokens: jax.Array
    """[B, N] int32: generated tokens; entries past num_generated[b] are 0."""
    num_generated: jax.Array
    """[B] int32: tokens written to `tokens` for each row (the EOS included)."""
    last_token: jax.Array
    """[B] int32: the newest token, not yet in the cache."""
    lengths: jax.Array
    """[B] int32: filled cache slots, i.e. the slot (and position) where last_token goes."""
    done: jax.Array
    """[B] bool: the row has emitted EOS (or is otherwise finished)."""
    cache: KVCache
    rng: jax.Array


PREFILL_CHUNK = 128
"""Prompt tokens per forward of a long prefill. One pass over a long prompt builds [T, T] attention
scores per head; on a CPU that is far slower than chunks of it (SmolLM2 in float32 on 2 cores: 2,048
tokens took 13.0 s in one pass and 5.3 s in chunks of 128; 4,096 tokens 15.9 s in chunks)."""
PREFILL_SEGMENT = 512
"""Chunks are scanned in segments of this many tokens, every chunk of a segment attending up to the
segment's end: one compiled chunk per segment rather than per chunk (compile time grows with the
prompt a segment at a time: 6 s at 2,048 tokens, 13 s at 4,096), while attention reads at most a
segment past what each chunk needs."""


def prefill(params, config: TransformerConfig, prompt_tokens, prompt_lengths, cache_length: int,
            hidden_layers=()):
    """Run right-padded prompts through the model. prompt_tokens: [B, T]; prompt_lengths: [B].

    Padding slots get garbage K/V, but they sit at or past each row's length, where attention
    never looks and the next write lands. Prompts longer than 2 * PREFILL_CHUNK run in chunks.
    Returns (last-token logits [B, V], cache, hidden [B, T, taps, d] or None).
    """
    batch, num_prompt = prompt_tokens.shape
    cache = KVCache.zeros(config, batch, cache_length)
    if num_prompt <= 2 * PREFILL_CHUNK:
        positions = jnp.broadcast_to(jnp.arange(num_prompt, dtype=jnp.int32), (batch, num_prompt))  # [B, T]
        out = forward(params, config, prompt_tokens, positions, cache, jnp.zeros((batch,), jnp.int32),
                      hidden_layers=hidden_layers, logit_positions=(prompt_lengths - 1)[:, None],
                      valid_lengths=prompt_lengths, empty_cache=True)
        return out.logits[:, 0], out.cache, out.hidden
    return _chunked_prefill(params, config, prompt_tokens, prompt_lengths, cache, tuple(hidden_layers))


def _chunked_prefill(params, config: TransformerConfig, prompt_tokens, prompt_lengths, cache: KVCache,
                     hidden_layers: tuple[int, ...]):
    batch, num_prompt = prompt_tokens.shape
    last = prompt_lengths - 1  # [B] the index whose logits start decoding

    def run(cache, logits, tokens, start, attend_slots: int):
        """One chunk [B, C] at prompt offset `start` (traced); keeps the logits of rows whose last
        prompt token is in it."""
        width = tokens.shape[1]
        positions = start + jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))  # [B, C]
        out = forward(params, config, tokens, positions, cache, jnp.full((batch,), start, jnp.int32),
                      hidden_layers=hidden_layers, logit_positions=jnp.clip(last - start, 0, width - 1)[:, None],
                      valid_lengths=jnp.clip(prompt_lengths - start, 0, width), attend_slots=attend_slots)
        here = (last >= start) & (last < start + width)  # [B]
        return out.cache, jnp.where(here[:, None], out.logits[:, 0], logits), out.hidden

    logits = jnp.zeros((batch, config.vocab_size), jnp.float32)
    hidden = []
    whole = num_prompt // PREFILL_CHUNK * PREFILL_CHUNK
    for segment_start in range(0, whole, PREFILL_SEGMENT):
        segment_end = min(segment_start + PREFILL_SEGMENT, whole)
        count = (segment_end - segment_start) // PREFILL_CHUNK
        chunks = prompt_tokens[:, segment_start:segment_end].reshape(batch, count, PREFILL_CHUNK).swapaxes(0, 1)

        def one_chunk(carry, xs, attend_slots=segment_end):
            cache, logits = carry
            tokens, start = xs
            cache, logits, features = run(cache, logits, tokens, start, attend_slots)
            return (cache, logits), features

        starts = segment_start + PREFILL_CHUNK * jnp.arange(count, dtype=jnp.int32)
        (cache, logits), features = jax.lax.scan(one_chunk, (cache, logits), (chunks, starts))
        if hidden_layers:  # [count, B, C, taps, d] -> [B, count * C, taps, d]
            hidden.append(jnp.swapaxes(features, 0, 1).reshape(batch, count * PREFILL_CHUNK, *features.shape[3:]))
    if whole < num_prompt:
        cache, logits, features = run(cache, logits, prompt_tokens[:, whole:], jnp.int32(whole), num_prompt)
        if hidden_layers:
            hidden.append(features)
    return logits, cache, jnp.concatenate(hidden, axis=1) if hidden_layers else None


def _eos_array(eos_token_ids: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(eos_token_ids or (-1,), jnp.int32)


@partial(jax.jit, static_argnames=("config", "sampling", "max_new_tokens", "eos_token_ids", "cache_length"))
def start_autoregressive(params, prompt_tokens, prompt_lengths, rng, *, config: TransformerConfig,
                         sampling: SamplingConfig, max_new_tokens: int, eos_token_ids: tuple[int, ...],
                         cache_length: int) -> DecodeState:
    """Prefill and sample the first token of every row. eos_token_ids=() never stops (ignore_eos)."""
    batch = prompt_tokens.shape[0]
    rng, first_rng = jax.random.split(rng)
    logits, cache, _ = prefill(params, config, prompt_tokens, prompt_lengths, cache_length)
    first = sample(logits, first_rng, sampling)  # [B]
    return DecodeState(
        step=jnp.int32(1),
        tokens=jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((batch,), jnp.int32),
        last_token=first,
        lengths=prompt_lengths.astype(jnp.int32),
        done=jnp.isin(first, _eos_array(eos_token_ids)),
        cache=cache,
        rng=rng,
    )


@partial(jax.jit, static_argnames=("config", "sampling", "eos_token_ids"), donate_argnames=("state",))
def continue_autoregressive(params, state: DecodeState, until_step, *, config: TransformerConfig,
                            sampling: SamplingConfig, eos_token_ids: tuple[int, ...]) -> DecodeState:
    """Decode inside one while_loop until `until_step` tokens per row exist or every row is done.

    until_step is a traced value, so one executable serves any number of chunks: a caller that
    streams text runs it a chunk at a time, a caller that does not runs it once to the end.
    """
    eos = _eos_array(eos_token_ids)
    max_new_tokens = state.tokens.shape[1]
    until_step = jnp.minimum(until_step, max_new_tokens)

    def keep_going(s: DecodeState):
        return (s.step < until_step) & ~jnp.all(s.done)

    def one_token(s: DecodeState):
        rng, step_rng = jax.random.split(s.rng)
        out = forward(params, config, s.last_token[:, None], s.lengths[:, None], s.cache, s.lengths)
        token = sample(out.logits[:, 0], step_rng, sampling)  # [B]
        live = ~s.done
        return DecodeState(
            step=s.step + 1,
            tokens=s.tokens.at[:, s.step].set(jnp.where(live, token, 0)),
            num_generated=s.num_generated + live.astype(jnp.int32),
            last_token=token,
            # Finished rows stop advancing so they can never run past the cache.
            lengths=s.lengths + live.astype(jnp.int32),
            done=s.done | jnp.isin(token, eos),
            cache=out.cache,
            rng=rng,
        )

    return jax.lax.while_loop(keep_going, one_token, state)
