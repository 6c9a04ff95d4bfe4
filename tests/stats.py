"""Chi-square goodness of fit against an exactly enumerated distribution (shared by sampler tests)."""

from __future__ import annotations

import numpy as np
from jax.scipy.special import gammaincc


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of observing counts under probs. Cells expected below min_expected are pooled, the
    usual condition for the chi-square approximation to hold."""
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64) / np.sum(probs)
    total = counts.sum()
    expected = probs * total
    small = expected < min_expected
    if counts[probs == 0].sum() > 0:
        return 0.0  # a sample the distribution cannot produce
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(gammaincc(dof / 2.0, stat / 2.0)) if dof > 0 else 1.0
