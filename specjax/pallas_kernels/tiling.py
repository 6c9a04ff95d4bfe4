"""Tile-size rules shared by the Pallas kernels (Triton lowering constraints)."""

from __future__ import annotations

from jax.experimental import pallas as pl

# Triton's tl.dot needs every matrix side to be at least 16.
MIN_TILE = 16


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def clamped_block(requested: int, extent: int) -> int:
    """The block actually used along an axis of length `extent`: no bigger than the padded axis needs."""
    return min(requested, max(MIN_TILE, pl.next_power_of_2(max(extent, 1))))


def check_block_sizes(block_sizes) -> None:
    """Refuse tiles Triton cannot lower: block_q/block_k must be powers of two >= MIN_TILE."""
    for name in ("block_q", "block_k"):
        value = getattr(block_sizes, name)
        if not is_power_of_two(value) or value < MIN_TILE:
            raise ValueError(f"BlockSizes.{name}={value}: must be a power of two >= {MIN_TILE} (Triton tiles)")
    if block_sizes.num_warps < 1 or block_sizes.num_stages < 1:
        raise ValueError(f"BlockSizes num_warps={block_sizes.num_warps}, "
                         f"num_stages={block_sizes.num_stages}: must be >= 1")


def check_head_dim(head_dim: int) -> None:
    """The compiled (Triton) kernels need a power-of-two head dim of at least MIN_TILE."""
    if not is_power_of_two(head_dim) or head_dim < MIN_TILE:
        raise ValueError(f"q has head dim D={head_dim}; the Triton kernel needs a power of two >= {MIN_TILE}")
