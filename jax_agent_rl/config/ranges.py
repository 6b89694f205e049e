"""What a number of the config accepts, declared on its field: ``setting(8, COUNT)`` is a field
whose default is 8 and whose values must be at least one. A field that moved keeps its old
dotted keys on the field (``was=``; a moved section's on its field, `moved_from`), so a config
still spelling one is told the new key."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class Rule(NamedTuple):
    """What a number must satisfy, and how an error message says it."""

    ok: Callable[[Any], bool]
    accepted: str


def finite_number(v: Any) -> bool:
    """``math.isfinite``, false for an int past a float's range too (where it raises: a
    310-digit override ended ``jarl train`` in an OverflowError traceback)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def interval(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
) -> Rule:
    """``lo <= v <= hi`` (either end open). Infinity, NaN and ints past a float's range never
    pass."""

    def ok(v: Any) -> bool:
        above = lo < v if lo_open else lo <= v
        below = v < hi if hi_open or hi == math.inf else v <= hi
        return bool(above and below and finite_number(v))

    if hi == math.inf:
        return Rule(ok, f"{'>' if lo_open else '>='} {lo:g}")
    return Rule(ok, f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}")


def or_(value: Any, rule: Rule) -> Rule:
    """``value`` itself (an "off" setting), or what ``rule`` accepts."""
    shown = "null" if value is None else value
    return Rule(lambda v: v == value or rule.ok(v), f"{shown} or {rule.accepted}")


COUNT = interval(1)  # sizes and counts that must be at least one
NATURAL = interval(0)  # counts where 0 means none / off
POSITIVE = interval(0, lo_open=True)
FRACTION = interval(0, 1)
# a timeout: positive, at most a million seconds (11.6 days: "never", in practice); the waits
# it bounds overflow past that (a pipe's poll takes a C int of milliseconds, 24.8 days; a
# lock's acquire about 9.2e9 s: OverflowError)
TIMEOUT = interval(0, 1e6, lo_open=True)
# MiB of address space: at most a billion (about a petabyte); past 2**43 MiB the byte count
# overflows setrlimit's C long, and the process it bounds died at its start
MEBIBYTES = interval(1, 1e9)
BELOW_ONE = interval(0, 1, hi_open=True)
FINITE = Rule(finite_number, "a finite number")
# the largest reward magnitude taken (`rewards.checked_reward`): far beyond any task's scale,
# and small enough that a group's sums and squared deviations (~1e12 * its size) stay finite
# in float32 (~3.4e38)
MAX_ABS_REWARD = 1e6
# a penalty: at most 0, and one the reward check takes (below it, every episode given it
# ended as a reward error, untrained: the penalty never reached the learner)
PENALTY = interval(-MAX_ABS_REWARD, 0)
# a penalty's size, added to rewards after their check (DAPO's overlong penalty): within
# the same bound, or a reward went -inf in float32 and its group's advantages NaN
PENALTY_SIZE = interval(0, MAX_ABS_REWARD)


def setting(default: T, rule: Rule | None = None, *, was: str | tuple[str, ...] = "") -> T:
    """A config field with ``default``, the values it accepts (``rule``; every int and float
    field has one) and the dotted keys it had before it moved (``was``), if it did."""
    metadata: dict[str, Any] = {}
    if rule is not None:
        metadata["range"] = rule
    if was:
        metadata["was"] = (was,) if isinstance(was, str) else was
    return dataclasses.field(default=default, metadata=metadata)


def moved_from(*keys: str) -> dict[str, Any]:
    """The metadata of a config section that moved (``dataclasses.field(default_factory=...,
    metadata=moved_from("rollout.ray"))``): each of its keys under an old dotted key is told
    its new one."""
    return {"was": keys}
