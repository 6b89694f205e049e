"""Answer extraction and numeric equivalence, on hand-written cases."""

import pytest

from jax_agent_rl.rewards import extract_answer, format_reward, get_reward, math_equal


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
        ("x + 1", "x+1", True),
        (None, "1", False),
    ],
)
def test_math_equal(predicted: str | None, truth: str, equal: bool) -> None:
    assert math_equal(predicted, truth) is equal


def test_rewards_registry() -> None:
    assert get_reward("math")("<answer>7</answer>", 7) == 1.0
    assert get_reward("math")("<answer>8</answer>", 7) == 0.0
    assert format_reward("<think>a</think><answer>1</answer>") == 1.0
    assert format_reward("<think>a<answer>1</answer>") == 0.0
    assert format_reward("<answer>1</answer><answer>2</answer>") == 0.0
    with pytest.raises(KeyError, match="unknown reward 'f1'"):
        get_reward("f1")
