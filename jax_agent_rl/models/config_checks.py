"""The value checks of `ModelConfig` and its parts: each failure an `UnsupportedConfigError`
that names the config.json key."""

from __future__ import annotations

import math
from typing import Any


class UnsupportedConfigError(ValueError):
    """An HF config field (named in the message) that this decoder cannot honour."""


def shown(value: object, limit: int = 60) -> str:
    """``value``'s repr for a one-line message, cut to ``limit`` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for Python to print
        return f"<a {type(value).__name__} too long to print>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_size(key: str, value: object, bound: int) -> int:
    """``value`` as a size: a whole number (not a bool) from 1 to ``bound``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
        raise UnsupportedConfigError(
            f"{key}={shown(value)} is not a size this decoder accepts: expected a whole number "
            f"from 1 to {bound}"
        )
    return value


def check_positive(key: str, value: object, above: float = 0.0, below: float = math.inf) -> float:
    """``value`` as a float: a finite number (not a bool) above ``above`` and below ``below``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        x = float(value) if abs(value) < 1e308 else math.inf
        if math.isfinite(x) and above < x < below:
            return x
    limit = "" if below == math.inf else f" and below {below:g}"
    raise UnsupportedConfigError(
        f"{key}={shown(value)}: expected a finite number above {above:g}{limit}"
    )


def flag(hf: dict[str, Any], field: str, default: bool) -> bool:
    value = hf.get(field, default)
    if not isinstance(value, bool):
        raise UnsupportedConfigError(f"{field}={shown(value)}: expected true or false")
    return value
