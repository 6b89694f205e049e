"""Rewards for math answers: extract the final answer, compare numerically, check the format.

`extract_answer` takes the last ``<answer>...</answer>`` or ``\\boxed{...}`` (balanced braces)
in the model's text, outside ``<think>`` blocks. `math_equal` compares two answers as numbers
when both parse (integers, decimals, fractions like ``3/4``, ``\\frac{3}{4}``, thousands
separators, a trailing unit-free ``%`` or ``$``), up to a relative tolerance of 1e-6; otherwise
as normalised strings.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The model's final answer, or None when it gave none in a recognised form."""
    visible = _THINK.sub("", text)
    tagged = _ANSWER.findall(visible)
    if tagged:
        return tagged[-1].strip()
    boxed = _last_boxed(visible)
    return boxed.strip() if boxed is not None else None


def parse_number(s: str) -> Fraction | float | None:
    s = s.strip().strip("$").replace(",", "").replace("\\!", "").strip()
    s = re.sub(r"^\\boxed\{(.*)\}$", r"\1", s)
    m = re.fullmatch(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    percent = s.endswith("%") or s.endswith("\\%")
    s = s.removesuffix("\\%").removesuffix("%").strip()
    try:
        value: Fraction | float = Fraction(s)
    except (ValueError, ZeroDivisionError):
        try:
            value = float(s)
        except ValueError:
            return None
    return value / 100 if percent else value


def math_equal(predicted: str | None, truth: str | float | int, rel_tol: float = 1e-6) -> bool:
    if predicted is None:
        return False
    a, b = parse_number(predicted), parse_number(str(truth))
    if a is not None and b is not None:
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-9)
    norm = lambda x: re.sub(r"\s+", "", str(x)).lower()  # noqa: E731
    return norm(predicted) == norm(truth)


def math_reward(text: str, ground_truth: str | float | int) -> float:
    """1.0 when the extracted answer equals the ground truth, else 0.0."""
    return float(math_equal(extract_answer(text), ground_truth))


def format_reward(text: str) -> float:
    """1.0 when the final message carries exactly one ``<answer>`` block and no unclosed
    ``<think>``; 0.0 otherwise."""
    if text.count("<think>") != text.count("</think>"):
        return 0.0
    return float(len(_ANSWER.findall(_THINK.sub("", text))) == 1)
