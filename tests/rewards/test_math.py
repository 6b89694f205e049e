"""Answer extraction, numeric equivalence and the GSM8K scorer, on hand-written cases."""

import pytest

from jax_agent_rl.rewards import (
    extract_answer,
    format_reward,
    gsm8k_answer,
    gsm8k_lenient_reward,
    math_equal,
    math_reward,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so <answer>42</answer>", "42"),
        ("<answer>1</answer> then <answer> 2 </answer>", "2"),
        ("The result is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("\\boxed{x^{2}} and finally \\boxed{7}", "7"),
        ("<think><answer>9</answer></think>no answer", None),
        ("\\boxed{unbalanced", None),
        ("nothing here", None),
    ],
)
def test_extract(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("predicted", "truth", "equal"),
    [
        ("42", 42, True),
        ("42.0", "42", True),
        ("1,234", "1234", True),
        ("\\frac{3}{4}", "0.75", True),
        ("3/4", "0.75", True),
        ("50%", "0.5", True),
        ("$12", "12", True),
        ("0.333", "1/3", False),
        ("0.33333333", "1/3", True),  # within the documented 1e-6 relative tolerance
        ("41", "42", False),
        # whole numbers are compared exactly: the tolerance would take 1000001 for 1000000
        ("1000001", "1000000", False),
        ("1.000001e6", "1000000", False),
        ("1e6", "1,000,000", True),
        ("123456789012345678", "123456789012345679", False),
        ("x + 1", "x+1", True),
        (None, "1", False),
        # MATH-style LaTeX that does not change the value
        ("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", True),
        ("\\tfrac{1}{4}", "0.25", True),
        ("\\left( 3, \\! 4 \\right)", "(3,4)", True),
        ("90^\\circ", "90", True),
        ("45^{\\circ}", "45.0", True),
        ("\\$1,000", "1000", True),
        ("x = 5.", "x=5", True),
        ("\\leftarrow", "arrow", False),  # only the sizing commands are dropped
        ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{2}}{2}", False),
    ],
)
def test_math_equal(predicted: str | None, truth: str, equal: bool) -> None:
    assert math_equal(predicted, truth) is equal


def test_math_and_format_rewards() -> None:
    assert math_reward("<answer>7</answer>", 7) == 1.0
    assert math_reward("<answer>8</answer>", 7) == 0.0
    assert math_reward("The area is \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}") == 1.0
    assert format_reward("<think>a</think><answer>1</answer>") == 1.0
    assert format_reward("<think>a<answer>1</answer>") == 0.0
    assert format_reward("<answer>1</answer><answer>2</answer>") == 0.0


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("48 / 2 = 24 clips in May.\n#### 72", "72"),  # verl's strict format
        ("#### 1,234 then, to check: #### 1,235", "1,235"),  # the last one
        ("#### $18", "18"),
        ("#### -3.5", "-3.5"),
        ("So the total is <answer>72 clips</answer>, from 3 steps", "72"),  # the answer's number
        ("It costs \\boxed{\\$1,200}.", "1,200"),
        ("48 + 24 = 72", "72"),  # verl's flexible fallback: the last number
        ("<think>#### 5</think> I get 6", "6"),  # thinking is not the answer
        ("no number here", None),
    ],
)
def test_gsm8k_answer(text: str, answer: str | None) -> None:
    assert gsm8k_answer(text) == answer


@pytest.mark.parametrize(
    ("text", "truth", "reward"),
    [
        ("... so she sold 72.\n#### 72", "72", 1.0),
        # the ground truth as GSM8K writes it: the whole solution, ending in "#### <answer>"
        ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 1.0),
        ("<answer>72</answer>", "#### 72", 1.0),
        ("#### 72.00", "72", 1.0),  # numbers compare as numbers
        ("#### 1,234", "1234", 1.0),
        ("#### 71", "#### 72", 0.0),
        ("I cannot tell.", "#### 72", 0.0),
    ],
)
def test_gsm8k_lenient_reward(text: str, truth: str, reward: float) -> None:
    assert gsm8k_lenient_reward(text, truth) == reward


def test_gsm8k_ground_truth_scores_zero_under_the_math_reward() -> None:
    """Why GSM8K rows need their own scorer: the ``math`` reward reads the ground truth whole."""
    assert math_reward("<answer>72</answer>", "#### 72") == 0.0
    assert gsm8k_lenient_reward("<answer>72</answer>", "#### 72") == 1.0
