"""Model text against the rewards, the judge, the parsers and the tool executor, a sixth pass:
what a policy can write to make a reward take unbounded time, score an answer that is not the
ground truth, or reach a tool with values no strict JSON writer takes; and tool state that
outlived its trajectory or held a call for ever.

Before the fixes: ``####`` followed by 100,000 spaces held the ``gsm8k_lenient`` reward for
about three minutes (its final-answer regex split the run of spaces between two ``\\s*`` every
way); the judge's score regex took 44 s for 4,000 spaces after an unclosed ``<score>``, on the
event loop; ``1e999`` in a tool call reached tools as ``inf``; ``7e-10`` scored for ``3e-10``,
``35`` for ``3, 5`` and ``<answer></answer>`` for an empty ground truth; a state created after
its trajectory's release was never released; and a ``create`` that never returned held its call
past the tool timeout, for ever."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.rewards.judge import JudgeAnswerError, parse_score
from jax_agent_rl.rewards.math import gsm8k_answer, gsm8k_lenient_reward, math_reward
from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser
from jax_agent_rl.tools.base import Tool, ToolResult, function_schema
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry


@pytest.mark.timeout(60)  # a bound on a hang: the linear scan takes milliseconds
def test_a_final_answer_mark_followed_by_a_long_run_of_spaces_is_read_in_linear_time() -> None:
    spaces = " " * 100_000  # quadratic: ~3 minutes; 8,000 spaces took 1 s
    assert gsm8k_lenient_reward(f"####{spaces}x", "42") == 0.0
    assert gsm8k_lenient_reward(f"####{spaces}$ 42", "42") == 1.0
    assert gsm8k_lenient_reward(f"#### ${spaces}x the answer is 42", "42") == 1.0
    # every way GSM8K's line is written still reads
    for line in ("####42", "#### 42", "#### $42", "####$ 42", "#### \n $ \t42", "#### $1,042.5"):
        assert gsm8k_answer(f"so {line}") == line.rpartition("$")[2].split()[-1].lstrip("#")


@pytest.mark.parametrize("number", ["1e999", "-1e400", "1" + "0" * 400 + ".0"])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_number_past_float_range_in_a_call_is_an_error_as_infinity_is(
    parser: str, number: str
) -> None:
    """``1e999`` is the ``Infinity`` the parsers refuse, spelled as a number: Python's JSON
    reads it as ``inf``, which reached a tool run in-process as ``inf`` and a harness behind the
    OpenAI endpoint as ``Infinity`` in the call's arguments (no strict JSON reader takes it).
    Also when the arguments are double-encoded; the largest finite float still reads."""
    name_key = "arguments" if parser == "hermes" else "parameters"

    def parsed(arguments: str) -> list[ParsedCall]:
        call = f'{{"name": "f", "{name_key}": {arguments}}}'
        return make_parser(parser).parse(
            f"<tool_call>{call}</tool_call>" if parser == "hermes" else call
        )

    for arguments in (f'{{"x": {number}}}', json.dumps(f'{{"x": {number}}}')):
        (call,) = parsed(arguments)
        assert call.error is not None and "past a float's range" in call.error, call
    assert parsed('{"x": 1.7976931348623157e308}') == [
        ParsedCall("f", {"x": 1.7976931348623157e308})
    ]


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


def _held() -> str:
    """Runs after a slow start."""
    return ""


class _HeldCreate(Tool):
    """A tool whose ``create`` waits for ``go`` (a container starting, say); ``live`` holds the
    states created and not yet released."""

    def __init__(self) -> None:
        self.name = "held"
        self.schema = function_schema(_held)
        self.creating, self.go = asyncio.Event(), asyncio.Event()
        self.live: set[str] = set()

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> str:
        del create_kwargs
        self.creating.set()
        await self.go.wait()
        self.live.add(trajectory_id)
        return trajectory_id

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del arguments
        return ToolResult(f"ran on {state}")

    async def release(self, state: Any) -> None:
        self.live.discard(state)


def test_state_created_after_its_trajectory_was_released_is_released_too() -> None:
    """A release that crosses a call still creating its state (a client that gave up on the
    call, as the tool server's callers do at an episode's timeout, while the server ran it on)
    found no state to release; the state was then created into a trajectory no longer open and
    held for the rest of the server's life, closing it included."""

    async def crossed() -> tuple[ToolResult, set[str], set[str]]:
        t = _HeldCreate()
        tools = LocalTools(ToolRegistry([t]))
        call = asyncio.ensure_future(tools.call("a", "held", {}))
        await t.creating.wait()
        await tools.release("a")
        t.go.set()
        result = await call
        after_call = set(t.live)
        again = await tools.call("a", "held", {})  # the id's next call starts fresh, as usual
        assert again == ToolResult("ran on a")
        await tools.close()
        return result, after_call, t.live

    result, after_call, after_close = asyncio.run(crossed())
    assert result.error and "was released while this call created its state" in result.text
    assert after_call == set() and after_close == set()


@pytest.mark.parametrize(
    "answer", ["<answer></answer>", "<answer> . </answer>", "<answer>$$</answer>", "\\boxed{}"]
)
@pytest.mark.parametrize("truth", ["", " ", "$"])
def test_an_answer_of_nothing_never_matches(answer: str, truth: str) -> None:
    """An answer that normalises to nothing compared equal, as strings, with a ground truth
    that does too: a row whose ground truth was left empty paid an empty answer."""
    assert math_reward(answer, truth) == 0.0


_SCORE_REGEX = re.compile(r"<score>\s*(.*?)\s*</score>", re.IGNORECASE | re.DOTALL)  # cubic


def _score_by_regex(text: str, score_max: float) -> float | None:
    """`parse_score` read with ``_SCORE_REGEX``: every tag's text a number, all the same one,
    in [0, ``score_max``]; None for an error."""
    try:
        values = {float(found) for found in _SCORE_REGEX.findall(text)}
    except ValueError:
        return None
    if len(values) != 1:
        return None
    (value,) = values
    return value / score_max if 0.0 <= value <= score_max else None


def _score_or_none(text: str, score_max: float) -> float | None:
    try:
        return parse_score(text, score_max)
    except JudgeAnswerError:
        return None


@pytest.mark.timeout(60)  # a bound on a hang: the linear scan takes milliseconds
def test_a_judges_score_tag_followed_by_a_long_run_of_spaces_is_read_in_linear_time() -> None:
    """The judge's answer is parsed on the trainer's event loop; a tag never closed followed
    by spaces or newlines (a judge talked into writing them) took time cubic in their number."""
    spaces = " \n" * 50_000  # cubic: 4,000 took 44 s
    for text in (f"<score>{spaces}", f"<score>{spaces}x", "<score>" * 50_000 + spaces):
        with pytest.raises(JudgeAnswerError, match="no <score>N</score>"):
            parse_score(text, 10)
    assert parse_score(f"<SCORE>{spaces}7{spaces}</Score>", 10) == 0.7


@hypothesis.settings(max_examples=500, deadline=None)
@hypothesis.given(
    st.lists(
        st.sampled_from(
            [
                "<score>",
                "</score>",
                "<SCORE>",
                "</Score>",
                " ",
                "\n",
                "\xa0",
                "7",
                "1.5",
                "x",
                "<",
                "nan",
            ]
        ),
        max_size=10,
    ).map("".join)
)
def test_a_judges_score_reads_as_the_regex_read_it(text: str) -> None:
    assert _score_or_none(text, 10) == _score_by_regex(text, 10)


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


def test_a_state_whose_creation_never_ends_fails_the_call_at_its_timeout() -> None:
    """The tool timeout bounded ``execute`` only: a ``create`` waiting on a service that never
    answers held its call, so its episode and the step gathering it, for ever (the test
    bounds it at 30 s). It is the call's error result at the timeout now; the trajectory's
    next call tries again."""

    async def stuck() -> tuple[ToolResult, ToolResult, set[str]]:
        t = _HeldCreate()  # its create waits for `go`, which this test sets only at the end
        tools = LocalTools(ToolRegistry([t]), timeout_s=0.01)
        first = await asyncio.wait_for(tools.call("a", "held", {}), 30)
        t.go.set()
        second = await asyncio.wait_for(tools.call("a", "held", {}), 30)
        await tools.close()
        return first, second, t.live

    first, second, live = asyncio.run(stuck())
    assert first == ToolResult("error: held timed out after 0.01s", error=True)
    assert second == ToolResult("ran on a") and live == set()
