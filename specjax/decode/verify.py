"""Acceptance rules for a chain of drafted tokens. Both keep the target's output distribution exactly.

Indexing used throughout: a verify pass feeds [last, d_1, …, d_K] to the target; target row i
(0 ≤ i ≤ K) is the distribution p_i of the token after the first i+1 fed tokens, so draft d_k
is checked against p_{k-1}, and p_n gives the bonus/correction token after n acceptances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def leading_true(flags: jax.Array) -> jax.Array:
    """Length of the all-True prefix of each row. flags: [B, K] bool -> [B] int32."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=-1), axis=-1)


def accept_greedy(draft: jax.Array, target_logits: jax.Array):
    """draft: [B, K] tokens; target_logits: [B, K+1, V].

    Returns (n_accepted [B], next_token [B]): drafts match the target's argmax for n tokens, then
    the target's own argmax at row n is the bonus (all accepted) or correction token.
    """
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    n = leading_true(draft == target_tokens[:, :-1])
    return n, jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]


def accept_sampled(draft: jax.Array, draft_probs: jax.Array, target_probs: jax.Array, rng: jax.Array):
    """Speculative sampling (Leviathan et al. / Chen et al.) for one chain.

    draft: [B, K] tokens sampled from draft_probs [B, K, V]; target_probs: [B, K+1, V] (already
    temperature/top-k/top-p processed). Accept d_k with probability min(1, p(d_k) / q(d_k)); at the
    first rejection sample from norm(max(p - q, 0)); if all K survive, sample the bonus from p_K.
    Returns (n_accepted [B], next_token [B]).
    """
    batch, num_draft = draft.shape
    accept_rng, resample_rng = jax.random.split(rng)
    p_draft = jnp.take_along_axis(target_probs[:, :-1], draft[..., None], axis=-1)[..., 0]  # [B, K]
    q_draft = jnp.take_along_axis(draft_probs, draft[..., None], axis=-1)[..., 0]  # [B, K]
    uniform = jax.random.uniform(accept_rng, (batch, num_draft))
    # u < p/q written as u*q < p, which needs no division and is exact when q == 0 cannot occur.
    n = leading_true(uniform * q_draft < p_draft)
    p_next = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)  # row K: no draft
    q_next = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]  # [B, V]
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = residual.sum(-1, keepdims=True)
    # mass is 0 only when p == q, where rejection has probability 0; fall back to p for safety.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    next_token = jax.random.categorical(resample_rng, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, next_token


def transfer_target(target_logits: jax.Array, target_probs: jax.Array, draft_probs: jax.Array, eta: float):
    """RAPID's knowledge transfer: the target's distribution shifted toward the drafter's where the
    drafter is confident. g = p - q, mask = q >= 0.1 max q, z' = z - eta * mask * g, p' = softmax(z').
    target_logits, target_probs, draft_probs: [..., V] (processed: filtered tokens are -inf / 0).
    eta = 0 gives p back. Lossy for eta > 0: output then follows neither p nor q."""
    mask = draft_probs >= 0.1 * draft_probs.max(-1, keepdims=True)
    return jax.nn.softmax(target_logits - eta * mask * (target_probs - draft_probs), axis=-1)


def accept_transfer(draft: jax.Array, draft_probs: jax.Array, target_logits: jax.Array, eta: float,
                    rng: jax.Array):
    """Speculative sampling against RAPID's shifted target (`transfer_target`), as RAPID's code does
    it: accept d_k with probability min(1, p'(d_k) / q(d_k)); at the first rejection sample from
    norm(max(0, max(p - q, p - p'))); the bonus after K acceptances comes from the target's own p_K.
    draft [B, K], draft_probs [B, K, V], target_logits [B, K+1, V] (processed). At eta = 0 this is
    exactly `accept_sampled`; eta > 0 is lossy (opt-in, and labelled by the callers)."""
    batch, num_draft = draft.shape
    accept_rng, resample_rng = jax.random.split(rng)
    p = jax.nn.softmax(target_logits, axis=-1)  # [B, K+1, V]
    shifted = transfer_target(target_logits[:, :-1], p[:, :-1], draft_probs, eta)  # [B, K, V]
    p_draft = jnp.take_along_axis(shifted, draft[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft[..., None], axis=-1)[..., 0]
    n = leading_true(jax.random.uniform(accept_rng, (batch, num_draft)) * q_draft < p_draft)
    pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)  # noqa: E731  row K: no draft
    at_n = lambda x: jnp.take_along_axis(x, n[:, None, None], axis=1)[:, 0]  # noqa: E731
    p_next, q_next = at_n(p), at_n(pad(draft_probs))
    shifted_next = at_n(jnp.concatenate([shifted, p[:, -1:]], axis=1))  # the bonus row: p itself
    residual = jnp.maximum(0.0, jnp.maximum(p_next - q_next, p_next - shifted_next))
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    next_token = jax.random.categorical(resample_rng, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, next_token
