"""The one exception type specjax raises for bad input, so callers (and the CLI) can tell it apart."""


class SpecjaxError(ValueError):
    """Bad input or a bad file: the message says what was wrong and what to do."""


def check_at_least(least: float, **values: float) -> None:
    """Refuse any value below `least` (NaN included), naming it: check_at_least(1, steps=steps)."""
    for name, value in values.items():
        if not value >= least:
            raise SpecjaxError(f"{name} must be >= {least}, got {value}")


def check_positive_finite(**values: float) -> None:
    """Refuse any value that is not a finite number above 0 (a learning rate, a scale), naming it."""
    for name, value in values.items():
        if not 0 < value < float("inf"):
            raise SpecjaxError(f"{name} must be a finite number > 0, got {value}")


COMPUTE_DTYPES = ("float32", "bfloat16")
"""The compute precisions every model path supports (bf16: bf16 dot inputs, float32 accumulation)."""


def check_compute_dtype(dtype: str) -> None:
    """Refuse a compute precision no model path supports."""
    if dtype not in COMPUTE_DTYPES:
        raise SpecjaxError(f"unknown compute dtype {dtype!r}; available: {', '.join(COMPUTE_DTYPES)}")
