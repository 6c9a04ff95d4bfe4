"""Prompt lookup (n-gram) drafting: the draft-free baseline that vLLM, SGLang and llama.cpp ship.

The drafts are copied from the row's own context: find the most recent earlier place where the
context's last n tokens occurred, and propose the tokens that followed them there. Longer n-grams
are tried first (max_n down to min_n). Nothing is trained and nothing runs on the device but a
few comparisons, so each trained drafter can be read against what needs no training; on
rewriting and code-editing requests, which copy long stretches of their prompt, it can win.

The drafts are a deterministic function of the context, i.e. a one-hot draft distribution, so
verifying them with speculative sampling keeps the target's exact distribution (decode/verify.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError, check_at_least


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """How prompt lookup drafts."""

    drafts: int = 7
    """Tokens proposed (and verified) per step."""
    max_n: int = 4
    """Longest n-gram matched against the context's end; tried first."""
    min_n: int = 2
    """Shortest n-gram matched; with no match at any length the step proposes nothing (and commits
    the target's one token, as an AR step does)."""

    def __post_init__(self):
        check_at_least(1, drafts=self.drafts, min_n=self.min_n)
        if self.max_n < self.min_n:
            raise SpecjaxError(f"ngram max_n ({self.max_n}) must be >= min_n ({self.min_n})")


def propose_ngram(history: jax.Array, lengths: jax.Array, last_token: jax.Array, config: NgramConfig):
    """Each row's drafts, copied from its context.

    history: [S, L] int32, the tokens at the row's target cache slots (valid below lengths);
    lengths: [S] int32; last_token: [S] int32, the newest token, at slot lengths (not in history yet).
    Returns (drafts [S, K] int32, available [S] int32): available counts the drafts that are real
    copies (0 where no n-gram matched); later entries are filler that the step never commits."""
    rows, width = history.shape
    seq = history.at[jnp.arange(rows), lengths].set(last_token, mode="drop")  # [S, L]
    end = lengths + 1  # [S] tokens in the context, last_token included
    at = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, L]
    follow = jnp.full((rows,), -1, jnp.int32)  # [S] first copied slot, -1: no match yet
    for n in range(config.max_n, config.min_n - 1, -1):
        match = (at + n < end[:, None]) & (end[:, None] > n)  # an n-gram at i with a token after it
        for j in range(n):
            suffix_j = jnp.take_along_axis(seq, jnp.clip(end - n + j, 0, width - 1)[:, None], axis=1)  # [S, 1]
            match &= jnp.roll(seq, -j, axis=1) == suffix_j  # seq[i + j]; wrapped entries fail `at + n < end`
        latest = jnp.max(jnp.where(match, at, -1), axis=1)  # [S] the most recent occurrence
        follow = jnp.where((follow < 0) & (latest >= 0), latest + n, follow)
    index = jnp.clip(follow[:, None] + jnp.arange(config.drafts, dtype=jnp.int32), 0, width - 1)  # [S, K]
    drafts = jnp.take_along_axis(seq, index, axis=1)
    available = jnp.where(follow >= 0, jnp.minimum(config.drafts, end - follow), 0).astype(jnp.int32)
    return drafts.astype(jnp.int32), available


def propose_ngram_reference(context: list[int], config: NgramConfig) -> list[int]:
    """The drafts for one row's whole context (last token included), in plain Python."""
    for n in range(config.max_n, config.min_n - 1, -1):
        if len(context) <= n:
            continue
        suffix = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i : i + n] == suffix:
                return context[i + n : i + n + config.drafts]
    return []


def propose_ngram_numpy(history: np.ndarray, lengths: np.ndarray, last_token: np.ndarray, config: NgramConfig):
    """propose_ngram's (drafts, available) through the reference, for tests."""
    drafts = np.zeros((len(lengths), config.drafts), np.int32)
    available = np.zeros(len(lengths), np.int32)
    for r, (row, length, last) in enumerate(zip(history, lengths, last_token)):
        found = propose_ngram_reference(list(row[:length]) + [int(last)], config)
        drafts[r, : len(found)], available[r] = found, len(found)
    return drafts, available
