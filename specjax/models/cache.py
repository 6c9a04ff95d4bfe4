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
    def zeros(cls, config: TransformerConfig, batch_size: int, max_length: int, dtype=None,
              bf16_as_bits: bool = True) -> "KVCache":
        """An empty cache for max_length positions; sliding layers get rings when the config asks.
        bf16 entries are stored as their bits (`BF16_BITS`) unless bf16_as_bits is off, for a
        reader that takes the arrays as they are (the drafter's context)."""
        dtype = jnp.dtype(dtype or config.cache_dtype)
        dtype = storage_dtype(dtype) if bf16_as_bits else dtype
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


BF16_BITS = jnp.uint16
"""How a bf16 cache is stored. XLA:CPU updates a bf16 buffer out of place: it widens the whole
buffer to float32 around every write, so one token written into a 32-row, 512-slot SmolLM2 cache
took 114 ms (30 layers) against 0.2 ms in float32. A 16-bit integer buffer holding the same bits is
written in place, and reading it back as bf16 is a free bitcast, on every backend."""


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a cache of `dtype` entries is stored in: bf16 as its bits, others as themselves."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(BF16_BITS) if dtype == jnp.bfloat16 else dtype


def to_storage(x: jax.Array, stored) -> jax.Array:
    """x as entries of a buffer of dtype `stored` (a bf16 value becomes its bits)."""
    if jnp.dtype(stored) == BF16_BITS and x.dtype != BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(stored)


def read_cache(buffer: jax.Array, dtype) -> jax.Array:
    """A cache buffer's entries as values of `dtype` (bf16 bits are bitcast back first)."""
    if buffer.dtype == BF16_BITS:
        buffer = jax.lax.bitcast_convert_type(buffer, jnp.bfloat16)
    return buffer.astype(dtype)


def write_rows(buffer: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
    """Write update[b] into buffer[b, start[b]:start[b]+T].

    buffer: [B, S, ...]; update: [B, T, ...]; start: [B] int32.
    """
    update = to_storage(update, buffer.dtype)

    def one_row(row, new, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new, s, axis=0)

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
    update = to_storage(update, buffer.dtype)

    def one_row(row, new, ix):
        return row.at[ix].set(new, mode="drop")

    return jax.vmap(one_row)(buffer, update, index)


def tree_bytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of a pytree."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
