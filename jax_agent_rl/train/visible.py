"""Model text and tool output made safe to show: control characters visible, never obeyed.

A model (or a tool it called) can write terminal escape sequences (clear the screen, set the
clipboard through OSC 52, forge a link), bidirectional overrides that reorder what a reader
sees, or bytes a terminal takes as C1 controls. `visible` maps each such character to a
printable stand-in, so a trace shows what was written instead of doing it: C0 controls and DEL
as their Unicode control pictures (ESC as ``␛``), C1 controls and bidi controls as ``\\x9b`` /
``\\u202e`` escapes. Newlines and tabs stay. `number` writes a float, NaN and infinities
included, the way a person reads it.
"""

from __future__ import annotations

import math

_BIDI = frozenset(
    [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)  # marks, embeddings, overrides, isolates


def _stand_in(code: int) -> str | None:
    if code in (0x09, 0x0A):  # tab, newline
        return None
    if code < 0x20:
        return chr(0x2400 + code)  # ␀ ... ␟ (ESC: ␛)
    if code == 0x7F:
        return "\u2421"  # ␡
    if 0x80 <= code <= 0x9F:
        return f"\\x{code:02x}"
    if code in _BIDI:
        return f"\\u{code:04x}"
    return None


_TABLE = {c: s for c in [*range(0xA0), *_BIDI] if (s := _stand_in(c)) is not None}


def visible(text: str) -> str:
    """``text`` with every control, C1 and bidi character replaced by its stand-in."""
    return text.translate(_TABLE)


def number(x: float, digits: int = 4) -> str:
    """``x`` to ``digits`` significant digits; NaN and infinities as ``nan``, ``inf``,
    ``-inf``."""
    return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
