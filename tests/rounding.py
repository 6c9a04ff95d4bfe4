"""Comparing float32 results of two differently shaped programs that compute the same values."""

from __future__ import annotations

import numpy as np

ULPS = 32
"""How many float32 units in the last place, at the compared values' largest magnitude, two programs may
differ by. XLA:CPU splits and vectorises a reduction by shape and by CPU kind (AVX-512 against AVX2
only), so the same sum reassociates: one logit in 120 of the refiner test landed 12 ulps away on an
AVX2 host while agreeing to 1e-6 on AVX-512. A real error (a wrong mask, a missed slot) is orders of
magnitude larger."""


def assert_rounding_close(actual, desired, ulps: int = ULPS) -> None:
    """actual equals desired up to float32 reassociation: within `ulps` ulps of max(1, max |desired|)."""
    actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    scale = max(1.0, float(np.abs(desired).max(initial=0.0)))
    np.testing.assert_allclose(actual, desired, rtol=0, atol=ulps * float(np.finfo(np.float32).eps) * scale)
