"""The drafter's context state during decoding: a full K/V cache, or a bounded windowed state.

Full attention (`DrafterConfig.window is None`): a `KVCache` with one entry per committed token,
so it grows with the context.

Windowed drafting (`DrafterConfig.window` set): a `WindowedContext` of fixed size, whatever the
context length.
- A ring of the last `window + block` positions' K/V. Slot = position mod ring size, and each slot
  remembers its position, so visibility is a comparison, not a layout invariant.
- The pre-norm context states of the last two segments (slot = position mod 2·segment), which the
  compressor reads once a segment is finished.
- The summary tokens' K/V, `summaries` per finished segment.
Raw features of older positions are never stored.

Both kinds are written by `append_context` (after each verify step) and `prefill_context` (the
prompt), and read by `context_key_sets`. Rejected drafts' entries land past the committed length,
where nothing reads them, and the next step overwrites them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.cache import KVCache, tree_bytes, write_rows
from specjax.models.drafter import ContextKeys, Drafter, DrafterConfig


@struct.dataclass
class WindowedContext:
    """Bounded drafter state of windowed drafting (see the module docstring)."""

    ring: KVCache
    """Per layer [B, R, K, D]: K/V of the last R = window + block positions written."""
    ring_positions: jax.Array
    """[B, R] int32: the position each ring slot holds, -1 when empty."""
    pending: jax.Array
    """[B, 2S, d]: pre-norm context states of the current and previous segment (slot = position mod 2S)."""
    summaries: KVCache
    """Per layer [B, M, K, D]: summary c of segment n at slot n*C + c."""


DrafterContext = KVCache | WindowedContext


def empty_context_cache(config: DrafterConfig, batch: int, cache_length: int) -> DrafterContext:
    """The drafter's empty context state for contexts of up to cache_length positions."""
    layer = config.layer_config
    if config.window is None:
        return KVCache.zeros(layer, batch, cache_length, bf16_as_bits=False)  # the drafter reads it as is
    window = config.window
    dtype = jnp.dtype(config.dtype)
    return WindowedContext(
        ring=KVCache.zeros(layer, batch, window.ring_slots(config.block_size), bf16_as_bits=False),
        ring_positions=jnp.full((batch, window.ring_slots(config.block_size)), -1, jnp.int32),
        pending=jnp.zeros((batch, 2 * window.segment, config.hidden_size), dtype),
        summaries=KVCache.zeros(layer, batch, window.summary_slots(cache_length), bf16_as_bits=False),
    )


def context_state_bytes(config: DrafterConfig, batch: int, cache_length: int) -> int:
    """Bytes of the drafter's context state for contexts of cache_length positions (no allocation)."""
    return tree_bytes(jax.eval_shape(lambda: empty_context_cache(config, batch, cache_length)))


def _apply(drafter_params, drafter_config: DrafterConfig, method, *args):
    return Drafter(drafter_config).apply({"params": drafter_params}, *args, method=method)


def _write_ring_and_pending(drafter_params, drafter_config: DrafterConfig, context: WindowedContext, states,
                            positions, ring_keep, pending_keep) -> WindowedContext:
    """Write pre-norm states [B, T, d] at positions [B, T] into the ring (where ring_keep [B, T]) and
    the pending segments (where pending_keep); the kept positions of a row must be distinct modulo
    the ring size and modulo 2S respectively."""
    window = drafter_config.window
    ring_size = context.ring_positions.shape[1]
    kv = _apply(drafter_params, drafter_config, Drafter.states_keys_values, states, positions)
    ring_slot = jnp.where(ring_keep, positions % ring_size, ring_size)  # out of range: dropped by the scatter
    pending_slot = jnp.where(pending_keep, positions % (2 * window.segment), 2 * window.segment)

    def scatter(buffer, update, slots):
        return jax.vmap(lambda row, new, where: row.at[where].set(new.astype(row.dtype), mode="drop"))(
            buffer, update, slots)

    return WindowedContext(
        ring=KVCache(keys=tuple(scatter(c, k, ring_slot) for c, (k, _) in zip(context.ring.keys, kv)),
                     values=tuple(scatter(c, v, ring_slot) for c, (_, v) in zip(context.ring.values, kv))),
        ring_positions=scatter(context.ring_positions, positions.astype(jnp.int32), ring_slot),
        pending=scatter(context.pending, states, pending_slot),
        summaries=context.summaries,
    )


def _summarise_finished_segment(drafter_params, drafter_config: DrafterConfig, context: WindowedContext,
                                old_lengths, new_lengths) -> WindowedContext:
    """Summarise the segment that the step from old_lengths to new_lengths [B] finished, if any (a
    step commits at most one block <= one segment, so at most one segment finishes)."""
    window = drafter_config.window
    segment, per_segment = window.segment, window.summaries
    finished = new_lengths // segment  # [B] segments fully committed
    is_new = finished > old_lengths // segment  # [B]
    index = jnp.maximum(finished - 1, 0)  # [B] the segment to summarise
    half = (index % 2) * segment
    states = jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, segment, axis=0))(
        context.pending, half)  # [B, S, d]
    centre = (index * segment + segment // 2)[:, None]  # [B, 1]
    kv = _apply(drafter_params, drafter_config, Drafter.summary_keys_values, states[:, None], centre)
    slot = index * per_segment  # [B]

    def write(buffer, update):  # only rows that finished a segment change
        current = jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, per_segment, axis=0))(
            buffer, slot)
        return write_rows(buffer, jnp.where(is_new[:, None, None, None], update.astype(buffer.dtype), current), slot)

    summaries = KVCache(keys=tuple(write(c, k) for c, (k, _) in zip(context.summaries.keys, kv)),
                        values=tuple(write(c, v) for c, (_, v) in zip(context.summaries.values, kv)))
    return context.replace(summaries=summaries)


def append_context(drafter_params, drafter_config: DrafterConfig, context: DrafterContext, features, positions,
                   write_index, committed_lengths=None) -> DrafterContext:
    """Write drafter context for features [B, T, taps, d] at positions [B, T], the first of them at
    slot/position write_index [B]. committed_lengths [B]: the rows' committed lengths after this step
    (windowed drafting summarises a segment once it is committed; required there)."""
    if isinstance(context, KVCache):
        kv = _apply(drafter_params, drafter_config, Drafter.context_keys_values, features, positions)
        return KVCache(
            keys=tuple(write_rows(c, k, write_index) for c, (k, _) in zip(context.keys, kv)),
            values=tuple(write_rows(c, v, write_index) for c, (_, v) in zip(context.values, kv)),
        )
    if committed_lengths is None:
        raise ValueError("windowed drafting needs committed_lengths to know when a segment is finished")
    states = _apply(drafter_params, drafter_config, Drafter.context_states, features)  # [B, T, d]
    keep = jnp.ones(positions.shape, bool)
    context = _write_ring_and_pending(drafter_params, drafter_config, context, states, positions, keep, keep)
    return _summarise_finished_segment(drafter_params, drafter_config, context, write_index, committed_lengths)


def prefill_context(drafter_params, drafter_config: DrafterConfig, batch: int, cache_length: int, features,
                    prompt_lengths) -> DrafterContext:
    """The drafter context after the prompt: features [B, P, taps, d] of the (right-padded) prompts,
    prompt_lengths [B]."""
    prompt_len = features.shape[1]
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    context = empty_context_cache(drafter_config, batch, cache_length)
    if isinstance(context, KVCache):
        return append_context(drafter_params, drafter_config, context, features, positions,
                              jnp.zeros((batch,), jnp.int32))
    window = drafter_config.window
    states = _apply(drafter_params, drafter_config, Drafter.context_states, features)  # [B, P, d]
    lengths = prompt_lengths.astype(jnp.int32)

    # Summaries of every segment the prompt finishes, computed for all of them at once.
    num_segments = min(prompt_len // window.segment, context.summaries.max_length // window.summaries)
    if num_segments:
        segments = states[:, : num_segments * window.segment].reshape(batch, num_segments, window.segment, -1)
        centres = jnp.arange(num_segments, dtype=jnp.int32) * window.segment + window.segment // 2
        kv = _apply(drafter_params, drafter_config, Drafter.summary_keys_values, segments,
                    jnp.broadcast_to(centres, (batch, num_segments)))
        zero = jnp.zeros((batch,), jnp.int32)
        context = context.replace(summaries=KVCache(
            keys=tuple(write_rows(c, k, zero) for c, (k, _) in zip(context.summaries.keys, kv)),
            values=tuple(write_rows(c, v, zero) for c, (_, v) in zip(context.summaries.values, kv))))

    # The ring and the pending segments take each row's last positions before its own length only:
    # padding past a row's prompt must not overwrite positions its window still needs.
    span = max(context.ring_positions.shape[1], 2 * window.segment)
    recent = lengths[:, None] - span + jnp.arange(span, dtype=jnp.int32)  # [B, span] positions
    keep = recent >= 0
    gathered = jnp.take_along_axis(states, jnp.clip(recent, 0, prompt_len - 1)[:, :, None], axis=1)  # [B, span, d]
    ring_size = context.ring_positions.shape[1]
    # Positions older than what the ring (or the pending buffer) holds would collide with newer ones.
    in_ring = keep & (recent >= lengths[:, None] - ring_size)
    in_pending = keep & (recent >= lengths[:, None] - 2 * window.segment)
    return _write_ring_and_pending(drafter_params, drafter_config, context, gathered, recent, in_ring, in_pending)


def context_key_sets(drafter_config: DrafterConfig, context: DrafterContext, lengths, num_queries: int):
    """What a block drafted at lengths [B] attends to besides itself, as ContextKeys sets."""
    batch = lengths.shape[0]
    if isinstance(context, KVCache):
        visible = jnp.arange(context.max_length, dtype=jnp.int32)[None, :] < lengths[:, None]  # [B, S]
        return [ContextKeys(context.keys, context.values,
                            visible=jnp.broadcast_to(visible[:, None, :], (batch, num_queries, context.max_length)))]
    window = drafter_config.window
    positions = context.ring_positions  # [B, R]
    in_window = (positions >= 0) & (positions >= lengths[:, None] - window.window) & (positions < lengths[:, None])
    summary_slots = context.summaries.max_length
    visible_summaries = jnp.arange(summary_slots, dtype=jnp.int32)[None, :] < (
        (lengths // window.segment) * window.summaries)[:, None]  # [B, M]
    broadcast = lambda m: jnp.broadcast_to(m[:, None, :], (batch, num_queries, m.shape[1]))  # noqa: E731
    return [ContextKeys(context.ring.keys, context.ring.values, visible=broadcast(in_window)),
            ContextKeys(context.summaries.keys, context.summaries.values, visible=broadcast(visible_summaries))]
