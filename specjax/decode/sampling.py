"""Turning logits into the distribution to sample from, and sampling it.

`target_probs` is kept separate from `sample` because speculative decoding needs the processed
distribution p itself (top-k / top-p applied before the acceptance test), not just a draw from it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from the target's logits. Hashable: passed to jit as a static argument."""

    temperature: float = 0.0
    """0 means greedy (argmax); > 0 divides the logits before the softmax."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all. Tokens tied with the k-th are kept too, as
    in transformers; the distribution sampled is exactly the one speculative decoding checks against."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 keeps all."""

    def __post_init__(self):
        # NaN fails every comparison and inf turns the logits into NaN, so both are refused here.
        if not 0 <= self.temperature < float("inf"):
            raise SpecjaxError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecjaxError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecjaxError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """Temperature, top-k and top-p applied; removed tokens get -inf. logits: [..., V] float32."""
    logits = logits.astype(jnp.float32) / config.temperature
    vocab = logits.shape[-1]
    if config.top_k and config.top_k < vocab:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]  # [..., 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if config.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # [..., V] descending
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # A token is kept while the mass strictly before it is below top_p, so the top token always stays.
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < config.top_p
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def target_probs(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """The distribution the target samples from, [..., V]; one-hot on the argmax when greedy."""
    if config.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(processed_logits(logits, config), axis=-1)


def sample(logits: jax.Array, rng: jax.Array, config: SamplingConfig) -> jax.Array:
    """One token per row. logits: [B, V] -> [B] int32."""
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, processed_logits(logits, config), axis=-1).astype(jnp.int32)
