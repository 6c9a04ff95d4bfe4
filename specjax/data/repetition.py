"""How repetitive a token sequence is: distinct-n, the share of its n-grams that are distinct.

Acceptance can be high because the output has degenerated into a loop: a drafter predicts a loop
perfectly. So the monitor reports distinct-n beside tau, and held-out acceptance estimates leave
looping sequences out, or one of them can dominate the mean."""

from __future__ import annotations

from typing import Sequence


def distinct_n(ids: Sequence[int], n: int) -> float | None:
    """Distinct n-grams over all n-grams of a token sequence (None when it has none): 1.0 for text
    that never repeats an n-gram, near 0 for output stuck in a loop."""
    grams = [tuple(ids[i: i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


LOOPING_DISTINCT_3 = 0.5
"""Below this distinct-3 a sequence counts as stuck in a loop. SmolLM2's ordinary answers score
about 0.9 or more; a list that degenerates into "1111..." scores under 0.2."""


def is_looping(ids: Sequence[int], threshold: float = LOOPING_DISTINCT_3) -> bool:
    score = distinct_n(ids, 3)
    return score is not None and score < threshold
