"""What the built-in rewards and the guessing game read from the policy's text, attacked with
text a policy can write: thousands of ``<answer>`` tags never closed, a number with a huge
exponent (``1e10000000``) or past float's range, a 5,000-digit guess, and a reward past
float's range. Rewards and environment steps run on the trainer's event loop, so a reward
that takes minutes holds every episode of the run; one that raises ends its episode as
``reward_error`` (not trained on), so a wrong answer must score 0, never fail.

Before the fixes: the tag readers took time quadratic in the text (20,000 unclosed tags:
about 50 s each), ``1e10000000`` took 14 s and then raised OverflowError (``1e100000000``:
over a minute), ``1e400`` raised, a 5,000-digit guess ended its episode as ``env_error`` and
a reward of ``10**400`` raised OverflowError instead of `RewardError`.

More of the same, each found as a way to score an answer that is not the ground truth or to
hold a reward: ``####`` followed by 100,000 spaces held the ``gsm8k_lenient`` reward for about
three minutes (its final-answer regex split the run of spaces between two ``\\s*`` every way);
``7e-10`` scored for ``3e-10``, ``35`` for ``3, 5`` and ``<answer></answer>`` for an empty
ground truth. The math rewards deleted every space, so a space between digits joined two
numbers (``3 1/2``, a mixed number, scored for 15.5 and not for 3.5; ``3 5`` and ``$3$ $5$``
for 35); and they read a number with an exponent, or past int's 4,300 digits, as float reads
it, so ``1e-400`` (and ``0.`` followed by 5,000 zeros and a 1) scored for 0, the float it
underflows to; ``9.007199254740993e15`` for 2**53, the float it rounds to; ``1e400`` for
``1e401`` and 5,000 nines for ``inf``, all of them float's infinity. Kept as regressions:
answers hedged between numbers, and 100,000-character answers of each piece the number
readers' patterns repeat."""

from __future__ import annotations

import asyncio
import math
import re
from fractions import Fraction

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.compat.verl.rules import qa_em_score
from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, checked_step
from jax_agent_rl.envs.guess import GuessNumber, read_guess
from jax_agent_rl.rewards import RewardError, checked_reward
from jax_agent_rl.rewards.math import format_reward, gsm8k_answer, gsm8k_lenient_reward, math_reward
from jax_agent_rl.tokenization.tags import tagged

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


@pytest.mark.timeout(60)  # a bound on a hang: the linear scan takes milliseconds
def test_a_final_answer_mark_followed_by_a_long_run_of_spaces_is_read_in_linear_time() -> None:
    spaces = " " * 100_000  # quadratic: ~3 minutes; 8,000 spaces took 1 s
    assert gsm8k_lenient_reward(f"####{spaces}x", "42") == 0.0
    assert gsm8k_lenient_reward(f"####{spaces}$ 42", "42") == 1.0
    assert gsm8k_lenient_reward(f"#### ${spaces}x the answer is 42", "42") == 1.0
    # every way GSM8K's line is written still reads
    for line in ("####42", "#### 42", "#### $42", "####$ 42", "#### \n $ \t42", "#### $1,042.5"):
        assert gsm8k_answer(f"so {line}") == line.rpartition("$")[2].split()[-1].lstrip("#")


@pytest.mark.parametrize(
    ("answer", "truth"), [("7e-10", "3e-10"), ("-5e-10", "5e-10"), ("1e-300", "0.0000000004")]
)
def test_an_answer_near_a_tiny_ground_truth_in_absolute_terms_only_is_wrong(
    answer: str, truth: str
) -> None:
    """Two numbers neither of which is whole were equal within an absolute 1e-9, so any answer
    of magnitude under 1e-9 (the opposite sign too) scored for a ground truth that small; the
    relative tolerance still takes float's rounding of the same number."""
    assert math_reward(f"<answer>{answer}</answer>", truth) == 0.0
    assert math_reward(f"<answer>{truth}</answer>", truth) == 1.0
    assert math_reward("<answer>3.0000000000000001e-10</answer>", "3e-10") == 1.0


@pytest.mark.parametrize(
    "answer", ["<answer></answer>", "<answer> . </answer>", "<answer>$$</answer>", "\\boxed{}"]
)
@pytest.mark.parametrize("truth", ["", " ", "$"])
def test_an_answer_of_nothing_never_matches(answer: str, truth: str) -> None:
    """An answer that normalises to nothing compared equal, as strings, with a ground truth
    that does too: a row whose ground truth was left empty paid an empty answer."""
    assert math_reward(answer, truth) == 0.0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("35", "3, 5"),
        ("-21", "-2, 1"),
        ("123", "1,2,3"),
        ("15", "1,5"),
        ("1,5", "15"),
        ("1000", "10,00"),
    ],
)
def test_a_comma_that_separates_no_thousands_joins_no_digits(answer: str, truth: str) -> None:
    """Every comma was dropped before an answer was read as a number, so the digits of a list
    of answers ran together: ``35`` scored for the two solutions ``3, 5``, and ``1,5`` (a
    decimal comma) for 15. A comma between groups of three digits still separates thousands."""
    assert math_reward(f"<answer>{answer}</answer>", truth) == 0.0
    assert math_reward(f"<answer>{truth}</answer>", truth) == 1.0
    for grouped, whole in (("1,234", "1234"), ("-1,000,000.5", "-1000000.5"), ("$1,200", "1200")):
        assert math_reward(f"<answer>{grouped}</answer>", whole) == 1.0
    assert gsm8k_lenient_reward("#### 1,042", "1042") == 1.0
    assert gsm8k_lenient_reward("#### 1,2", "12") == 0.0


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


ANSWER_ATOMS = [
    *("1", "2", "0", "5", "9", " ", ",", ".", "e", "-", "+", "%", "\\%", "/", "_", "$"),
    *("\\frac{", "}{", "}", "\\!", "\\,", "\uff11", "inf", "nan", "000", "\\boxed{", "e-400"),
]


TRUTHS = ["0", "1", "2", "5", "10", "12", "15", "21", "25", "50", "100", "1000", "0.5", "1.5"]


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(ANSWER_ATOMS), min_size=1, max_size=7).map("".join))
def test_no_answer_scores_for_two_different_numbers(answer: str) -> None:
    """Held: an answer a policy unsure of the number writes scores for one of these ground
    truths at most (by the math and the lenient GSM8K rewards)."""
    for reward, text in (
        (math_reward, f"<answer>{answer}</answer>"),
        (gsm8k_lenient_reward, f"#### {answer}"),
    ):
        assert sum(reward(text, truth) for truth in TRUTHS) <= 1.0


@pytest.mark.timeout(60)  # a bound on a hang: each reading is linear, milliseconds
@pytest.mark.parametrize(
    "piece", ["1 ", "1 000", "111 ", "1 000 ", "\\,", "1\\,000\\,", "1,000,", "#### $", "e", "1e"]
)
def test_answers_of_a_repeated_piece_are_read_in_linear_time(piece: str) -> None:
    """Held: 100,000 characters of each piece the number readers' patterns repeat."""
    text = piece * (100_000 // len(piece))
    assert math_reward(f"<answer>{text}</answer>", "42") == 0.0
    assert math_reward("<answer>42</answer>", text) == 0.0
    assert gsm8k_lenient_reward(text + "x", "42") == 0.0
