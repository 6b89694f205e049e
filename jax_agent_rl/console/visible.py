"""Model text and tool output made safe to show: control characters visible, never obeyed.

A model (or a tool it called) can write terminal escape sequences (clear the screen, set the
clipboard through OSC 52, forge a link), bidirectional overrides that reorder what a reader
sees, bytes a terminal takes as C1 controls, or characters nobody sees at all (`INVISIBLE`:
Unicode tag characters, which can spell a whole hidden message, zero-width spaces and joiners,
byte-order marks, Hangul fillers, variation selectors). `visible` maps each such character to
a printable stand-in, so a trace shows what was written instead of doing or hiding it: C0
controls and DEL as their Unicode control pictures (ESC as ``␛``), C1 controls as ``\\x9b``,
bidi controls, invisible characters and lone surrogates (not text: no terminal prints one)
as ``\\u202e`` / ``\\U000e0041`` escapes. Newlines and tabs stay. `without_invisible` drops
the invisible ones instead (what a judge model reads). `lone_surrogate` finds text that is no
text at all: where a string, or JSON's values of strings, holds a lone surrogate, which no
tokenizer and no UTF-8 file takes (every place text comes in refuses it with it).
`number` writes a float, NaN and infinities included, the way a person reads it.
"""

from __future__ import annotations

import math
import re
import unicodedata

_BIDI = frozenset(
    [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)  # marks, embeddings, overrides, isolates

# every format character (category Cf: zero-width space, joiners, word joiner, BOM, soft
# hyphen, bidi controls, tags...); Unicode assigns them only in planes 0, 1 and 14
_FORMAT = frozenset(
    c
    for plane in (0x00000, 0x10000, 0xE0000)
    for c in range(plane, plane + 0x10000)
    if unicodedata.category(chr(c)) == "Cf"
)
INVISIBLE = _FORMAT | frozenset(
    [
        *range(0xE0000, 0xE0080),  # the whole tag block, unassigned ones included
        *range(0xFE00, 0xFE10),  # variation selectors
        *range(0xE0100, 0xE01F0),  # variation selectors supplement
        *range(0x180B, 0x1810),  # Mongolian free variation selectors
        0x034F,  # combining grapheme joiner
        0x115F, 0x1160, 0x3164, 0xFFA0,  # Hangul fillers: letters that print as nothing
    ]
)  # fmt: skip


def _escape(code: int) -> str:
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _stand_in(code: int) -> str | None:
    if code in (0x09, 0x0A):  # tab, newline
        return None
    if code < 0x20:
        return chr(0x2400 + code)  # ␀ ... ␟ (ESC: ␛)
    if code == 0x7F:
        return "\u2421"  # ␡
    if 0x80 <= code <= 0x9F:
        return f"\\x{code:02x}"
    if code in _BIDI or code in INVISIBLE or code in _SURROGATES:
        return _escape(code)
    return None


# lone surrogates: no terminal or UTF-8 file takes them (a console printing one raises); a
# data file's JSON (``"\ud83d"``, half an emoji) or an environment can hold them
_SURROGATES = range(0xD800, 0xE000)
_TABLE = {c: s for c in [*range(0xA0), *INVISIBLE, *_SURROGATES] if (s := _stand_in(c)) is not None}
_DROP = dict.fromkeys(INVISIBLE)
_SURROGATE = re.compile("[\ud800-\udfff]")


def visible(text: str) -> str:
    """``text`` with every control, C1, bidi and invisible character replaced by its
    stand-in."""
    return text.translate(_TABLE)


def without_invisible(text: str) -> str:
    """``text`` without its `INVISIBLE` characters."""
    return text.translate(_DROP)


def lone_surrogate(value: object) -> str | None:
    """Where ``value`` holds a lone surrogate (JSON's ``"\\ud83d"``, half of an emoji's escaped
    pair; a file name's undecodable byte, as ``os.fsdecode`` gives it), which no UTF-8 encoder
    takes, so neither a tokenizer nor a trace file: ``"at character 3 ('\\ud83d')"`` of the
    first string holding one, else None. ``value`` is a string or JSON's lists and objects of
    them, keys included, nested to any depth (walked without recursion); other values hold
    none."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found is not None:
                return f"at character {found.start()} ({found.group()!r})"
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed([x for pair in item.items() for x in pair]))
    return None


def number(x: float, digits: int = 4) -> str:
    """``x`` to ``digits`` significant digits; NaN and infinities as ``nan``, ``inf``,
    ``-inf``."""
    return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
