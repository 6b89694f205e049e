"""The error of a bad setting, shared by the config loader and verl's key table, and how an
error raised by user code is written (`error_text`)."""


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


def error_text(error: BaseException) -> str:
    """``Type: message`` of ``error``, also when its ``__str__`` itself fails (a library's
    exception formatting a value it holds): writing what went wrong must not raise in turn."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:
        return f"{type(error).__name__} (its message cannot be written)"
