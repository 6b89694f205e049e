"""The calculator against a policy that searches for inputs that hang it or crash it.

Every input either evaluates to an exact int or a finite float, or is a `CalculatorError` the
model reads; nothing hangs the event loop and nothing else escapes.


Kept as a regression: arguments past the calculator's bounds are its errors."""

from __future__ import annotations

import math

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.tools.calculator import CalculatorError, evaluate


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "expression",
    [
        "round(2, -10**9)",  # 10**(10**9) computed inside round: minutes holding the GIL
        "round(2, 10**9)",
        "round(2.5, 2.5)",
        "10.0 ** 400",
        "10**400 / 3",
        "sqrt(10**400)",
        "10**400 * 1.5",
        "1e308 * 10",
        "1e999",
        "(-8) ** 0.5",
        "3 ** -(10**400)",
        "sqrt(-1)",
        "min()",
        "max(" + ", ".join(["1"] * 100) + ")",
        "-" * 900 + "1",
        "+-" * 450 + "1",
        "1" + "+1" * 400,
        "(10**999) * (10**999) * (10**999) * (10**999) * (10**999)",
        "99999 ** 99999",
        "7 ** 5000",
        "1.5 % 0",
    ],
)
def test_hostile_expressions_are_calculator_errors(expression: str) -> None:
    with pytest.raises(CalculatorError):
        evaluate(expression)


EXACT = {
    "2 ** 12000": 2**12000,  # large results within the bounds stay exact
    "(-3) ** 5": -243,
    "round(1234, -2)": 1200,
    "round(2.675, 2)": round(2.675, 2),
    "2 ** -2": 0.25,
    "max(1, 2, 3) * 10**3000": 3 * 10**3000,
    "1 ** (10**999)": 1,
    "sqrt(2) ** 2": math.sqrt(2) ** 2,
}


@pytest.mark.parametrize("expression", EXACT)
def test_bounded_expressions_stay_exact(expression: str) -> None:
    result = evaluate(expression)
    assert result == EXACT[expression] and type(result) is type(EXACT[expression])


_ATOMS = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.sampled_from(["10**400", "10**999", "1e308", "0.0", "-0.5", "2.5", "0"]),
    st.integers(300, 999).map(lambda n: "9" * n),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
)
_OPS = ["+", "-", "*", "/", "//", "%", "**"]


def _expressions(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(children, st.sampled_from(_OPS), children).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        st.tuples(st.sampled_from(["-", "+"]), children).map("".join),
        st.tuples(
            st.sampled_from(["abs", "round", "min", "max", "sqrt"]), st.lists(children, max_size=3)
        ).map(lambda t: f"{t[0]}({', '.join(t[1])})"),
    )


@hypothesis.seed(20240611)
@hypothesis.settings(max_examples=600, derandomize=True, deadline=None)
@hypothesis.given(st.recursive(_ATOMS, _expressions, max_leaves=12))
@pytest.mark.timeout(60)
def test_fuzzed_expressions_give_a_number_or_a_calculator_error(expression: str) -> None:
    try:
        value = evaluate(expression)
    except CalculatorError:
        return
    assert type(value) in (int, float)
    assert isinstance(value, int) or math.isfinite(value)


@pytest.mark.parametrize(
    "expression",
    [
        "1e308 // 1e-308",  # float floor division to infinity
        "1 / 5e-324",
        "2 ** -(10**3900)",  # an int exponent past float's range, for a float result
        "1.0000001 ** (10**3900)",
        "(10**3900) % 7.0",
        "1.5 ** 1e308",
        "0.1 ** -1000",
        "(2**12999 + 2**12999) // 1",  # a sum one bit past the bound
        "round(2**12999 * 1.0)",
    ],
)
def test_calculator_arguments_past_its_bounds_are_its_errors(expression: str) -> None:
    """Held: each is a `CalculatorError` the model reads, at once."""
    with pytest.raises(CalculatorError):
        evaluate(expression)
