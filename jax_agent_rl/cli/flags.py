"""Numbers given as command-line flags, checked where they are read: a value outside what the
flag accepts is argparse's error naming the flag, before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from jax_agent_rl.config.ranges import Rule, interval

PORT = interval(0, 65535)  # 0: a free one
_KINDS = {int: "a whole number", float: "a number"}


def number(kind: type[int] | type[float], rule: Rule) -> Callable[[str], int | float]:
    """A flag's type: a ``kind`` number that ``rule`` accepts."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_KINDS[kind]}") from None
        if kind is float and not math.isfinite(value):  # 1e309 reads as inf: "not > 0" misled
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if not rule.ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {rule.accepted}")
        return value

    return parse
