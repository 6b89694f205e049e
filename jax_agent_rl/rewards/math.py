"""Rewards for math answers: extract the final answer, compare numerically, check the format.

`extract_answer` takes the last ``<answer>...</answer>`` or ``\\boxed{...}`` (balanced braces)
in the model's text, outside ``<think>`` blocks. `math_equal` first drops LaTeX that does not
change a value (``\\left``/``\\right``, ``\\!``, ``^\\circ``, ``$``, ``\\dfrac``/``\\tfrac`` read as
``\\frac``, ``\\,`` and ``\\;`` read as spaces, a trailing period) and every space but one
between two digits (``1 000``, digits in groups of three, is one number; ``3 5`` and the mixed
number ``3 1/2`` are no number, not 35 or 31/2), then compares two answers as numbers when both
parse (integers, decimals, exponents of a magnitude within 10**±4300, fractions like ``3/4``,
``\\frac{3}{4}``, commas between groups of three digits, a trailing ``%``), exactly, otherwise
as lower-cased strings (``inf``, ``nan`` and numbers past int's 4,300 digits too); an answer
left empty by this is no answer, whatever the ground truth. A whole number equals itself only,
and a number written with float's rounding noise (``56.99999999999999``, 0.57 * 100 as Python
prints it: within 2**-50 of it, relatively, so 0 only itself); two numbers of which neither is
whole are equal up to a relative tolerance of 1e-6 (and no absolute one: ``3e-10`` is not
``7e-10``).

`gsm8k_lenient_reward` (the ``gsm8k_lenient`` reward) reads a GSM8K answer however the model
wrote it: the number after the model's last ``####`` (spaces and a ``$`` allowed), else the last
number of its ``<answer>``/``\\boxed{}`` answer, else the last number it wrote; the ground truth
may be the bare number (verl's preprocessing) or a whole GSM8K solution ending in
``#### <number>``; numbers are compared as numbers (``72.0`` equals ``72``). It is not verl's
rule (`jax_agent_rl.compat.verl.rules.gsm8k_score`, the ``verl_gsm8k`` reward and the default
for ``openai/gsm8k`` rows), which takes only ``#### N`` in the last 300 characters and compares
it as a string: ``The answer is 15``, ``#### 15.0``, ``\\boxed{15}`` and ``<answer>15</answer>``
score 1.0 here and 0 there.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

from jax_agent_rl.tokenization.tags import tagged

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
# LaTeX that does not change a value: sizing, negative thin spaces, degree signs, dollar signs
_NO_VALUE = re.compile(r"\\(?:left|right)(?![a-zA-Z])|\\!|\^\{?\\circ\}?|\\?\$")
_LATEX_SPACE = re.compile(r"\\[,;]")  # thin and thick spaces: spaces
# a whole number's digits in groups of three parted by spaces ("1 000 000", SI's way)
_SPACED = re.compile(r"(?<!\d)(?<!\d )\d{1,3}(?: \d{3})+(?! ?\d)")
# a space that parts no two digits (one that does parts two numbers: "3 1/2" is not 31/2)
_LOOSE_SPACE = re.compile(r"(?<!\d) | (?!\d)")
# GSM8K's final-answer line; the "$" and its spaces are one optional group: "\s*\$?\s*" splits
# a run of spaces between its two halves every way, tried in turn (quadratic in the run)
_MARKED = re.compile(r"####\s*(?:\$\s*)?(-?\d[\d,]*(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
# a whole number's digits in groups of three: its commas are thousands separators (any other
# comma is no number's: "3, 5" is two answers, not 35)
_GROUPED = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d,])")
# the largest magnitude, as a power of ten, of a number written with an exponent that is read
# (10**4300: the digits int() reads); past it the number is compared as written
# (Fraction("1e100000000") builds 10**100000000)
_MAX_EXPONENT = 4300
# a whole number's float rounding noise: a few units in float's last place, relatively
_FLOAT_NOISE = Fraction(1, 2**50)


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
    answers = tagged(visible)
    if answers:
        return answers[-1].strip()
    boxed = _last_boxed(visible)
    return boxed.strip() if boxed is not None else None


def parse_number(s: str) -> Fraction | None:
    """``s``'s exact value, or None when it is no number or none read exactly (``inf``,
    ``nan``, more digits than int reads, a magnitude past 10**±`_MAX_EXPONENT` written with an
    exponent): float's reading made ``1e-400`` the 0 it underflows to and
    ``9.007199254740993e15`` the 2**53 it rounds to."""
    s = s.strip().strip("$").replace("\\!", "").strip()
    s = _GROUPED.sub(lambda m: m.group().replace(",", ""), s)
    s = re.sub(r"^\\boxed\{(.*)\}$", r"\1", s)
    m = re.fullmatch(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    percent = s.endswith("%") or s.endswith("\\%")
    s = s.removesuffix("\\%").removesuffix("%").strip()
    try:  # (Decimal's InvalidOperation is an ArithmeticError)
        if "e" in s.lower() and abs(Decimal(s).adjusted()) > _MAX_EXPONENT:
            return None
        value = Fraction(s)
    except (ValueError, ArithmeticError):
        return None
    return value / 100 if percent else value


def _normalise(answer: str) -> str:
    answer = _NO_VALUE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    answer = re.sub(r"\s+", " ", _LATEX_SPACE.sub(" ", answer))
    answer = _SPACED.sub(lambda m: m.group().replace(" ", ""), answer)
    return _LOOSE_SPACE.sub("", answer).rstrip(".").lower()


def math_equal(predicted: str | None, truth: str | float | int, rel_tol: float = 1e-6) -> bool:
    a_text, b_text = _normalise(predicted or ""), _normalise(str(truth))
    if not a_text:  # no answer, or one of nothing but spaces, "$" or "." ("" matched "")
        return False
    a, b = parse_number(a_text), parse_number(b_text)
    if a is not None and b is not None:
        if b.denominator == 1:  # a whole number is no other: neither 1000001 nor 1000000.5
            return _is_whole(a, b)
        if a.denominator == 1:
            return _is_whole(b, a)
        # neither is whole, so neither is 0: no absolute tolerance (1e-9 made every answer
        # within 1e-9 of a tiny ground truth right, 5e-10 for -5e-10 too); the tolerance as
        # written (1e-6, not float's nearest, a little under it)
        return abs(a - b) <= Fraction(str(rel_tol)) * max(abs(a), abs(b))
    return a_text == b_text


def _is_whole(value: Fraction, whole: Fraction) -> bool:
    """``value`` is the whole number ``whole``, or it but for float's rounding
    (`_FLOAT_NOISE`), and is nearer to it than to any other whole number: a relative tolerance
    would let one answer between two whole numbers (1000000.5) score for both."""
    return round(value) == whole and abs(value - whole) <= _FLOAT_NOISE * abs(whole)


def math_reward(text: str, ground_truth: str | float | int) -> float:
    """1.0 when the extracted answer equals the ground truth, else 0.0."""
    return float(math_equal(extract_answer(text), ground_truth))


def format_reward(text: str) -> float:
    """1.0 when the final message carries exactly one ``<answer>`` block and no unclosed
    ``<think>``; 0.0 otherwise."""
    if text.count("<think>") != text.count("</think>"):
        return 0.0
    return float(len(tagged(_THINK.sub("", text))) == 1)


def gsm8k_answer(text: str) -> str | None:
    """The model's GSM8K answer (see the module docstring), or None when it wrote no number."""
    visible = _THINK.sub("", text)
    marked = _MARKED.findall(visible)
    if marked:
        return marked[-1]
    answer = extract_answer(visible)
    numbers = _NUMBER.findall(visible if answer is None else answer)
    return numbers[-1] if numbers else None


def gsm8k_lenient_reward(text: str, ground_truth: str | float | int) -> float:
    """1.0 when the model's GSM8K answer equals the number after the ground truth's last
    ``####`` (or the whole ground truth, when it has none), else 0.0."""
    return float(math_equal(gsm8k_answer(text), str(ground_truth).rpartition("####")[2]))
