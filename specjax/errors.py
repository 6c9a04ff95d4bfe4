"""The one exception type specjax raises for bad input, so callers (and the CLI) can tell it apart."""


class SpecjaxError(ValueError):
    """Bad input or a bad file: the message says what was wrong and what to do."""
