"""Static-shape key/value cache.

Slot s of row b holds the keys and values of the token written there. Every row keeps its own
write index (`lengths[b]`): rows of a batch advance by different amounts under speculative
decoding, and slots at or past a row's length are garbage that attention never reads.
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
        dtype = dtype or jnp.dtype(config.dtype)
        shape = (batch_size, max_length, config.num_kv_heads, config.head_dim)
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
            values=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        )

    @property
    def max_length(self) -> int:
        return self.keys[0].shape[1]

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
