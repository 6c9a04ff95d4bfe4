"""Static-shape key/value cache.

Slot s of row b holds the keys and values of the token written there. Every row keeps its own
write index (`lengths[b]`): rows of a batch advance by different amounts under speculative
decoding, and slots at or past a row's length are garbage that attention never reads.

A sliding layer may keep a ring of R slots instead (TransformerConfig.kv_ring_step): slot s lives
at index s mod R, and only the last R slots survive. Full layers have one index per slot, which is
the same rule with R at least every slot ever written, so code that moves entries by slot uses
`ring_index` on every layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.config import TransformerConfig


@struct.dataclass
class KVCache:
    keys: tuple[jax.Array, ...]
    """One array per layer, each [B, S, K, D] (S cache slots, K key/value heads)."""
    values: tuple[jax.Array, ...]
    """Same shapes as keys."""

    @classmethod
    def zeros(cls, config: TransformerConfig, batch_size: int, max_length: int, dtype=None) -> "KVCache":
        """An empty cache for max_length positions; sliding layers get rings when the config asks."""
        dtype = dtype or jnp.dtype(config.cache_dtype)
        shape = lambda i: (batch_size, config.layer_cache_slots(i, max_length), config.num_kv_heads, config.head_dim)
        return cls(
            keys=tuple(jnp.zeros(shape(i), dtype) for i in range(config.num_layers)),
            values=tuple(jnp.zeros(shape(i), dtype) for i in range(config.num_layers)),
        )

    @property
    def max_length(self) -> int:
        """Slots of the longest layer (a full layer's, unless every layer is a ring)."""
        return max(k.shape[1] for k in self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]


def write_rows(buffer: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
    """Write update[b] into buffer[b, start[b]:start[b]+T].

    buffer: [B, S, ...]; update: [B, T, ...]; start: [B] int32.
    """
    def one_row(row, new, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new.astype(row.dtype), s, axis=0)

    return jax.vmap(one_row)(buffer, update, start)


def ring_index(slots: jax.Array, ring_slots: int) -> jax.Array:
    """Where slot s lives in a layer of ring_slots entries (see the module docstring)."""
    return slots % ring_slots


def write_ring(buffer: jax.Array, update: jax.Array, start: jax.Array, valid_lengths: jax.Array | None = None):
    """Write update[b, t] (slot start[b] + t) into a ring buffer [B, R, ...] at index (start[b] + t) mod R.

    Only the last R of each row's first valid_lengths[b] new tokens (default: all T) are written, so
    no index is written twice; the others would be overwritten in the ring anyway, or are padding.
    """
    ring = buffer.shape[1]
    num_new = update.shape[1]
    t = jnp.arange(num_new, dtype=jnp.int32)[None, :]  # [1, T]
    limit = jnp.full((buffer.shape[0], 1), num_new, jnp.int32) if valid_lengths is None else valid_lengths[:, None]
    keep = (t < limit) & (t >= limit - ring)  # [B, T]
    index = jnp.where(keep, ring_index(start[:, None] + t, ring), ring)  # [B, T]; ring = out of range, dropped

    def one_row(row, new, ix):
        return row.at[ix].set(new.astype(row.dtype), mode="drop")

    return jax.vmap(one_row)(buffer, update, index)


def tree_bytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of a pytree."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
