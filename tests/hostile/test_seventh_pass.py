"""Model text against the rewards, the tool-call parsers, the calculator, the trace viewer and
the OpenAI-compatible endpoint's requests, a seventh pass: what a policy can write to score an
answer that is not the ground truth, or to crash or hang what reads it.

Before the fixes: the math rewards deleted every space, so a space between digits joined two
numbers (``3 1/2``, a mixed number, scored for 15.5 and not for 3.5; ``3 5`` and ``$3$ $5$``
for 35); and they read a number with an exponent, or past int's 4,300 digits, as float reads
it, so ``1e-400`` (and ``0.`` followed by 5,000 zeros and a 1) scored for 0, the float it
underflows to; ``9.007199254740993e15`` for 2**53, the float it rounds to; ``1e400`` for
``1e401`` and 5,000 nines for ``inf``, all of them float's infinity. A first request to the
OpenAI-compatible endpoint whose tools held a lone surrogate, or nested as deep as its JSON
reader reads, failed past its checks (in the tokenizer, in encoding the tools a call deeper):
the endpoint's own failure, answered 500 and ended as ``agent_error`` with a traceback, rather
than the harness's bad request (400, ``harness_error``); and a body holding ``NaN`` or ``1e999``
(Python's JSON reader takes them, no strict one does) was taken, a NaN in the tools then making
every later request's tools differ from the first's. ``jarl view`` on a traces file of
100,000 one-character tool messages in one span took minutes to mark the tool tokens (each was
tested against every tool text found: quadratic); on a record nested past what the JSON reader
reads, or just within it in a count passed through into the page, it ended in a RecursionError
traceback. Held, and kept here as regressions: the calculator past its bounds, the tool-call
parsers on text made of JSON's and the tags' pieces, answers hedged between numbers, and
100,000-character answers of each piece the number readers' patterns repeat."""

from __future__ import annotations

import asyncio
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.agent.openai_endpoint import Session, serve
from jax_agent_rl.agent.openai_requests import HarnessError, check_request
from jax_agent_rl.cli import main
from jax_agent_rl.rewards.math import gsm8k_lenient_reward, math_reward
from jax_agent_rl.tokenization.tool_calls import PARSERS, make_parser
from jax_agent_rl.tools.calculator import CalculatorError, evaluate
from jax_agent_rl.train.traces import TRACES_FILE, read_traces
from jax_agent_rl.view.data import roles
from tests.agent.test_loop import CONFIG
from tests.agent.test_openai_endpoint import PROMPT, _context, _fresh
from tests.hostile.test_openai_endpoint import _port, _post, _status
from tests.train.test_view import hostile_record


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


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "function", "function": {"name": "f\ud800", "parameters": {}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"\udc00": {}}}}],
        [{"type": "function", "function": {"name": "f", "description": ["\ud83d"]}}],
    ],
)
def test_a_lone_surrogate_in_the_tools_of_a_request_is_the_harness_error(
    tools: list[dict[str, Any]],
) -> None:
    """The tools go into the prompt, whose tokenizer takes no lone surrogate: checked as the
    messages are, they were rendered, and the tokenizer's TypeError ended the episode as the
    endpoint's own failure (``agent_error``, answered 500) rather than the request's (400)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with pytest.raises(HarnessError, match="tools hold a lone surrogate") as refused:
        check_request(json.loads(json.dumps(body)))
    assert refused.value.status == 400
    paired = json.loads('"\\ud83d\\ude00"')  # a surrogate pair, read as JSON writes it
    pair = [{"type": "function", "function": {"name": "f", "description": paired}}]
    assert paired == "\U0001f600" and check_request({**body, "tools": pair})[1] == pair


def _tools_nested(depth: int) -> str:
    """A first request whose one tool's parameters are lists ``depth`` deep."""
    tools = '[{"type": "function", "function": {"name": "f", "parameters": ' + "[" * depth
    return (
        f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": {tools}{"]" * depth}}}}}]}}'
    )


def _complete(raw: str) -> Any:
    """What `Session.complete` does with a body: reads it, then checks it a call deeper."""
    return _checked(json.loads(raw))


def _checked(body: Any) -> Any:
    return check_request(body)


def test_tools_nested_as_deep_as_the_body_reader_reads_are_the_harness_error() -> None:
    """A first request's tools nested as deep as the endpoint's JSON reader reads: checked, they
    went on to be measured a call deeper (`Session._start`: ``json.dumps(tools)``), where their
    encoding ran past the recursion limit: a RecursionError, the endpoint's own failure (500,
    ``agent_error``) rather than the request's (400)."""
    depth = 2_000
    while True:  # the deepest body read
        try:
            with pytest.raises(HarnessError, match="tools nest too deep"):
                _complete(_tools_nested(depth))
            break
        except RecursionError:  # (the reader's)
            depth -= 1
    assert depth > 100
    assert _complete(_tools_nested(100))[1] is not None


def _roles_by_scan(pieces: list[str], mask: list[int], tool_texts: list[str]) -> str:
    """The view's token roles by the direct reading of its rule (each tool text found in turn
    in a mask-0 span, each token overlapping it ``t``): every token of the span is tested
    against every hit, which is quadratic."""
    out = ["s" if m else "p" for m in mask]
    texts, start = list(tool_texts), 0
    while start < len(pieces):
        end = start
        while end < len(pieces) and mask[end] == mask[start]:
            end += 1
        if not mask[start]:
            text, ends = "".join(pieces[start:end]), [0]
            for piece in pieces[start:end]:
                ends.append(ends[-1] + len(piece))
            at = 0
            while texts and texts[0] and (hit := text.find(texts[0], at)) >= 0:
                stop = hit + len(texts.pop(0))
                for i in range(start, end):
                    if ends[i - start] < stop and ends[i - start + 1] > hit:
                        out[i] = "t"
                at = stop
        start = end
    return "".join(out)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    st.lists(st.tuples(st.sampled_from(["", "a", "b", "ab", "ba", "aab"]), st.integers(0, 1))),
    st.lists(st.sampled_from(["", "a", "b", "ab", "aa", "bab"]), max_size=8),
)
def test_token_roles_are_those_of_the_rule_read_directly(
    tokens: list[tuple[str, int]], tool_texts: list[str]
) -> None:
    pieces, mask = [p for p, _ in tokens], [m for _, m in tokens]
    messages = [{"role": "tool", "content": t} for t in tool_texts]
    assert roles(pieces, mask, messages) == _roles_by_scan(pieces, mask, tool_texts)


@pytest.mark.timeout(60)  # a bound on a hang: the walk takes a fraction of a second
def test_many_tool_messages_in_one_span_are_shown_in_linear_time() -> None:
    """A traces file of 100,000 one-character tool messages in one span of as many tokens (3
    MB): every token was tested against every tool text found, minutes before the page was
    written (4,000 of them: a second)."""
    n = 100_000
    messages = [{"role": "tool", "content": "a"}] * n
    assert roles(["a"] * n, [0] * n, messages) == "t" * n
    assert roles(["a"] * n + ["b"], [0] * n + [1], messages[:10]) == "t" * 10 + "p" * (n - 10) + "s"


async def _first_request(setup: dict[str, Any], key: str, body: bytes) -> tuple[Session, bytes]:
    """A fresh session's answer to ``body``, its first request, over HTTP."""
    ctx = await _context(setup, CONFIG, None)
    session = _fresh(ctx, key)
    async with serve({key: session}) as base_url:
        answer = await _post(_port(base_url), key, body)
    await ctx.backend.close()
    return session, answer


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_lone_surrogate_in_a_first_requests_tools_ends_its_episode_as_a_harness_error(
    setup: dict[str, Any],
) -> None:
    tools = '[{"type": "function", "function": {"name": "f\\ud800", "parameters": {}}}]'
    body = f'{{"messages": {json.dumps(PROMPT)}, "tools": {tools}}}'.encode()
    session, answer = asyncio.run(_first_request(setup, "surrogate", body))
    assert _status(answer) == 400 and b"tools hold a lone surrogate" in answer
    assert session.stop == "harness_error" and session.traj.prompt_ids == []


@pytest.mark.parametrize(
    ("number", "problem"),
    [("NaN", b"NaN is not a JSON number"), ("1e999", b"1e999 is past a float's range")],
)
@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_request_body_of_numbers_strict_json_has_not_is_refused(
    setup: dict[str, Any], number: str, problem: bytes
) -> None:
    """``NaN`` and ``1e999`` (Python's reader takes them; no OpenAI client writes them) in a
    first request's tools were rendered into the prompt as no strict reader reads them back,
    and a NaN, unequal to itself, made every later request's tools differ from the first's: a
    harness error on the second request naming the wrong problem."""
    schema = '{"type": "number", "default": ' + number + "}"
    tools = (
        '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
        f'"properties": {{"x": {schema}}}}}}}}}]'
    )
    body = f'{{"messages": {json.dumps(PROMPT)}, "tools": {tools}}}'.encode()
    json.loads(body)  # (Python's reader takes it)
    session, answer = asyncio.run(_first_request(setup, "strict", body))
    assert _status(answer) == 400 and problem in answer
    assert session.stop == "harness_error" and session.traj.prompt_ids == []


def _nested_record(field: str, depth: int) -> str:
    """A trace record whose ``field`` (``tool_calls`` of its assistant message when the field
    is ``message_calls``) is a list nested ``depth`` deep."""
    record = hostile_record("h/0", None)
    deep = "[" * depth + "]" * depth
    if field == "message_calls":
        record["messages"][1]["tool_calls"] = "DEEP"  # type: ignore[index]
    else:
        record[field] = "DEEP"
    return json.dumps(record).replace('"DEEP"', deep) + "\n"


@pytest.mark.parametrize(
    "field", ["num_turns", "tool_calls", "token_versions", "uid", "message_calls"]
)
def test_a_trace_record_nested_as_deep_as_the_reader_reads_is_a_named_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """``jarl view`` on a traces file whose record nests a value ever deeper: past what the
    reader reads, the RecursionError of reading it; just within it, the RecursionError of
    writing it out deeper (a count passed through into the page's JSON, a uid written as
    text, a message's calls written as JSON), a traceback either way. Each is refused naming
    the file (exit 2)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    traces = run_dir / TRACES_FILE
    lo, hi = 100, 5000  # the reader reads lo deep here, not hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        traces.write_text(_nested_record(field, mid))
        try:
            read_traces(traces)
            lo = mid
        except (RecursionError, ValueError):  # (before the fix; after it)
            hi = mid
    for depth in range(lo - 20, lo + 3):  # jarl view reads a few calls deeper than here
        traces.write_text(_nested_record(field, depth))
        assert main(["view", str(run_dir), "--out", str(tmp_path / "page")]) in (0, 2), depth
        err = capsys.readouterr().err
        assert not err or str(traces) in err, err


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


ATOMS = [
    *("<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", "<|eom_id|>"),
    *("{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n", "\x00", '"\\"'),
    *('"name"', '"f"', '"arguments"', '"parameters"', "NaN", "1e999", "-0", "1", "null"),
    *("\\ud800", "\\udc00", "\\ud83d\\ude00", "```python\n", "```", "<python>", "</python>"),
]


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(ATOMS), max_size=16).map("".join))
def test_a_parsed_call_is_strict_json_or_an_error_and_nothing_raises(text: str) -> None:
    """Held: whatever a turn writes, every parser returns calls, and each call it accepts
    has a name and arguments a strict JSON writer takes (no NaN, no infinity, no lone
    surrogate)."""
    for name in PARSERS:
        parser = make_parser(name)
        parser.needs_more(text)
        for call in parser.parse(text):
            if call.error is None:
                assert isinstance(call.name, str) and call.name
                json.dumps([call.name, call.arguments], allow_nan=False).encode("utf-8")


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
