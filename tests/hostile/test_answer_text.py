"""What the built-in rewards and the guessing game read from the policy's text, attacked with
text a policy can write: thousands of ``<answer>`` tags never closed, a number with a huge
exponent (``1e10000000``) or past float's range, a 5,000-digit guess, and a reward past
float's range. Rewards and environment steps run on the trainer's event loop, so a reward
that takes minutes holds every episode of the run; one that raises ends its episode as
``reward_error`` (not trained on), so a wrong answer must score 0, never fail.

Before the fixes: the tag readers took time quadratic in the text (20,000 unclosed tags:
about 50 s each), ``1e10000000`` took 14 s and then raised OverflowError (``1e100000000``:
over a minute), ``1e400`` raised, a 5,000-digit guess ended its episode as ``env_error`` and
a reward of ``10**400`` raised OverflowError instead of `RewardError`."""

from __future__ import annotations

import asyncio
import re

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.compat.verl.rules import qa_em_score
from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, checked_step
from jax_agent_rl.envs.guess import GuessNumber, read_guess
from jax_agent_rl.rewards import RewardError, checked_reward
from jax_agent_rl.rewards.math import format_reward, gsm8k_lenient_reward, math_reward
from jax_agent_rl.tags import tagged

UNCLOSED = "<answer>" * 50_000  # the old regexes: minutes each


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(["<answer>", "</answer>", "a", "<", "/", "\n", "ans"])))
def test_tagged_finds_what_the_regex_finds(pieces: list[str]) -> None:
    text = "".join(pieces)
    assert tagged(text) == re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)


@pytest.mark.timeout(60)  # a bound on a hang, far past what the linear scan takes
def test_unclosed_answer_tags_are_read_in_linear_time() -> None:
    ends = f"<answer>42</answer>{UNCLOSED}"
    assert math_reward(ends, "42") == 1.0 and math_reward(UNCLOSED, "42") == 0.0
    assert format_reward(ends) == 1.0 and format_reward(UNCLOSED) == 0.0
    assert qa_em_score(ends, {"target": "42"}) == 0.25  # (verl's: right, past 10 tags)
    assert qa_em_score(UNCLOSED, {"target": "42"}) == 0
    assert read_guess(ends) == 42
    (row,) = reasoning_gym.samples("reasoning_gym:basic_arithmetic?size=1&seed=1", "tool_agent")
    right = f"<answer>{row.ground_truth}</answer>{UNCLOSED}"
    source = row.data_source
    assert reasoning_gym.score(source, right, None, row.extra) == 1.0
    assert reasoning_gym.score(source, UNCLOSED, None, row.extra) == 0.0


@pytest.mark.timeout(60)
def test_numbers_past_float_range_are_wrong_answers_not_errors() -> None:
    for answer in ("1e10000000", "1e400", "-1e400", "1" + "0" * 400, "9" * 5000):
        assert math_reward(f"<answer>{answer}</answer>", "42") == 0.0, answer[:12]
    # the same huge numbers are still equal to themselves, and an exponent is still a number
    assert math_reward("<answer>" + "1" + "0" * 400 + "</answer>", "1" + "0" * 400) == 1.0
    assert math_reward("<answer>1e3</answer>", "1000") == 1.0


def test_a_guess_of_more_digits_than_int_reads_is_no_number() -> None:
    game = GuessNumber(Sample(uid="g", messages=[], ground_truth="7"))
    step = asyncio.run(game.step(f"<answer>{'9' * 5000}</answer>", []))
    assert not step.done and step.reward == 0.0
    assert step.observations == [{"role": "user", "content": "Say one number."}]


def test_a_reward_past_float_range_is_a_reward_error() -> None:
    for value in (10**400, -(10**400), 10**5000):
        with pytest.raises(RewardError, match="not a finite number"):
            checked_reward(value, "the test")
        with pytest.raises(EnvError, match="not a finite number"):
            checked_step({"observations": [], "reward": value, "done": True}, "env")


@pytest.mark.parametrize(
    ("answer", "truths"),
    [
        # one answer between two whole numbers scored for both (the 1e-6 relative tolerance)
        ("1000000.5", ("1000000", "1000001")),
        ("1.0000005e6", ("1000000", "1000001")),
        ("12345678.9", ("12345670", "12345678", "12345679", "12345688")),
        ("42.00004", ("42",)),
        ("0.000000001", ("0",)),  # the absolute tolerance of 1e-9 around 0
        ("1e-12", ("0",)),
    ],
)
def test_a_number_that_is_not_whole_never_scores_for_a_whole_one(
    answer: str, truths: tuple[str, ...]
) -> None:
    """A policy unsure between whole numbers gains by answering one near them all: before,
    ``1000000.5`` scored 1.0 for both 1000000 and 1000001, ``12345678.9`` for every whole
    number from 12345666 to 12345691."""
    for truth in truths:
        assert math_reward(f"<answer>{answer}</answer>", truth) == 0.0, truth
        assert gsm8k_lenient_reward(f"#### {answer}", truth) == 0.0, truth


def test_a_whole_number_written_with_float_rounding_is_still_that_number() -> None:
    """What float arithmetic prints for 0.57 * 100 or 0.1 * 3 * 10 is the whole number it
    rounds (the test reads it from Python itself)."""
    for product, whole in ((0.57 * 100, "57"), (0.1 * 3 * 10, "3"), (4.35 * 100, "435")):
        assert str(product) != whole and not product.is_integer()
        assert math_reward(f"<answer>{product}</answer>", whole) == 1.0
        assert math_reward(f"<answer>{product}</answer>", str(int(whole) + 1)) == 0.0
