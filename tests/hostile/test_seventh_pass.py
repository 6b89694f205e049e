"""Model text against the rewards, the tool-call parsers, the calculator, the trace viewer and
the OpenAI-compatible endpoint's requests, a seventh pass: what a policy can write to score an
answer that is not the ground truth, or to crash or hang what reads it.

Before the fixes: the math rewards deleted every space, so a space between digits joined two
numbers (``3 1/2``, a mixed number, scored for 15.5 and not for 3.5; ``3 5`` and ``$3$ $5$``
for 35); and they read a number with an exponent, or past int's 4,300 digits, as float reads
it, so ``1e-400`` (and ``0.`` followed by 5,000 zeros and a 1) scored for 0, the float it
underflows to; ``9.007199254740993e15`` for 2**53, the float it rounds to; ``1e400`` for
``1e401`` and 5,000 nines for ``inf``, all of them float's infinity."""

from __future__ import annotations

import math
from fractions import Fraction

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.rewards.math import gsm8k_lenient_reward, math_reward


@pytest.mark.parametrize(
    ("answer", "wrong", "right"),
    [
        ("3 1/2", "15.5", "3 1/2"),  # a mixed number, read as 31/2
        ("3 5", "35", "3 5"),
        ("$3$ $5$", "35", "3 5"),
        ("3\\,5", "35", "3 5"),
        ("1 000 5", "10005", "1 000 5"),
    ],
)
def test_a_space_between_digits_parts_two_numbers(answer: str, wrong: str, right: str) -> None:
    assert math_reward(f"<answer>{answer}</answer>", wrong) == 0.0
    assert math_reward(f"<answer>{answer}</answer>", right) == 1.0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("1 000 000", "1000000"),  # digits in groups of three: one number
        ("1\\,000", "1000"),
        ("1\\;234\\;567", "1,234,567"),
        ("x = 5", "x=5"),
        ("\\left( 3, \\! 4 \\right)", "(3,4)"),
        (" 42 ", "42"),
    ],
)
def test_spaces_that_part_no_two_numbers_still_go(answer: str, truth: str) -> None:
    assert math_reward(f"<answer>{answer}</answer>", truth) == 1.0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("1e-400", "0"),  # float's 0.0
        ("-1e-400", "0"),
        ("1e-400", "2e-400"),  # both 0.0
        ("0." + "0" * 5000 + "1", "0"),  # past int's digits: float's 0.0
        ("9.007199254740993e15", "9007199254740992"),  # float's 2**53
        ("1.00000000000000001e17", "100000000000000000"),
        ("1e400", "1e401"),  # both float's inf
        ("9" * 5000, "inf"),
        ("1e999", "inf"),
        ("1e5000", "1e5001"),  # past the exponents read exactly: compared as written
    ],
)
def test_a_number_is_read_exactly_never_as_the_float_it_rounds_to(answer: str, truth: str) -> None:
    assert math_reward(f"<answer>{answer}</answer>", truth) == 0.0
    assert gsm8k_lenient_reward(f"<answer>{answer}</answer>", truth) == 0.0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("1e-400", "1e-400"),
        ("1e-400", "0.1e-399"),
        ("9.007199254740993e15", "9007199254740993"),
        ("4.2e1", "42"),
        ("1e400", "1" + "0" * 400),
        ("inf", "inf"),  # no number, the same text
        ("1e5000", "1e5000"),
        ("0.3333333", "\\frac{1}{3}"),  # within the relative 1e-6
        ("0.333333", "1/3"),  # at it, exactly
    ],
)
def test_numbers_read_exactly_still_equal_their_own_value(answer: str, truth: str) -> None:
    assert math_reward(f"<answer>{answer}</answer>", truth) == 1.0


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=1, max_value=10**6),
    st.sampled_from(["{n}/{d}", "\\frac{{{n}}}{{{d}}}"]),
)
def test_a_number_that_is_not_whole_scores_for_one_whole_number_at_most(
    n: int, d: int, form: str
) -> None:
    """``n/d`` (a policy unsure between whole numbers) scores for neither whole number around
    it unless it is within float's noise (2**-50, relatively) of it, and for one at most."""
    hypothesis.assume(n % d)
    value = Fraction(n, d)
    text = f"<answer>{form.format(n=n, d=d)}</answer>"
    scores = [math_reward(text, str(w)) for w in (math.floor(value), math.ceil(value))]
    for w, score in zip((math.floor(value), math.ceil(value)), scores, strict=True):
        assert score <= float(abs(value - w) <= abs(w) * Fraction(1, 2**50)), w
    assert sum(scores) <= 1.0
