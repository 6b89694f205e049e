"""Tool-call parsers against text a policy may write to crash them: every parser returns calls
(or what was wrong with them) for any text, and never raises."""

import asyncio
import json

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.tokenization.tool_calls import MAX_JSON_DEPTH, PARSERS, ParsedCall, make_parser
from jax_agent_rl.tools.app import create_app
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.registry import ToolRegistry
from tests.tools.test_server import serving

DEEP = "[" * 1000
HUGE = "1" * 4301  # past Python's 4,300-digit limit on int("...")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", f"<tool_call>{DEEP}</tool_call>"),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"x": ' + HUGE + "}}</tool_call>"),
        ("hermes", '<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": "' + HUGE + '"}</tool_call>'),
        ("llama3_json", '{"a":' * 1000 + "1"),
        ("llama3_json", '{"name": "f", "parameters": {"x": ' + HUGE + "}}"),
        ("llama3_json", '{"name": "f", "parameters": "' + DEEP + '"}'),
    ],
)
def test_undecodable_calls_are_errors(parser: str, text: str) -> None:
    calls = make_parser(parser).parse(text)
    assert calls and all(c.error for c in calls), calls


@pytest.mark.parametrize("value", ["NaN", "-Infinity", '"\\ud800"', '["a\\udfff"]'])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_arguments_no_strict_json_writer_takes_are_errors(parser: str, value: str) -> None:
    """NaN, Infinity and lone surrogates (``"\\ud800"``) parse in Python's JSON, but no strict
    JSON writer takes them back (httpx sends bodies with ``allow_nan=False``, as UTF-8), so
    arguments holding them could not reach a tool server: they are the model's error, also
    when the arguments are double-encoded; a surrogate pair (an emoji) is text."""
    name_key = "arguments" if parser == "hermes" else "parameters"

    def text(arguments: str) -> str:
        call = f'{{"name": "f", "{name_key}": {arguments}}}'
        return f"<tool_call>{call}</tool_call>" if parser == "hermes" else call

    for arguments in (f'{{"x": {value}}}', json.dumps(f'{{"x": {value}}}')):
        calls = make_parser(parser).parse(text(arguments))
        assert len(calls) == 1 and calls[0].error, calls
    (emoji,) = make_parser(parser).parse(text('{"x": "\\ud83d\\ude00"}'))
    assert emoji == ParsedCall("f", {"x": "\U0001f600"})


_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<|python_tag|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<python>",
    "</python>",
    "<tool>",
    "</tool>",
    "```",
    "```python\n",
    '{"name": "calculator", "arguments": ',
    '{"name": "f", "parameters": ',
    '"arguments": "',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    '\\"',
    ";",
    ":",
    ",",
    "\n",
    "null",
    "NaN",
    "1e999",
    "-Infinity",
    "\\ud800",
    "é",
    "\U0001f600",
    "\x00",
]
_TEXT = st.lists(
    st.one_of(
        st.sampled_from(_PIECES),
        st.text(max_size=20),
        st.integers(1, 1500).map(lambda n: "[" * n),
        st.integers(1, 1500).map(lambda n: '{"a":' * n),
        st.integers(4000, 5000).map(lambda n: "7" * n),
    ),
    max_size=12,
).map("".join)


def _well_formed(call: object) -> bool:
    if not isinstance(call, ParsedCall) or not isinstance(call.name, str):
        return False
    if call.error is None:
        return bool(call.name)
    return isinstance(call.error, str) and bool(call.error)


@hypothesis.seed(1729)
@hypothesis.settings(max_examples=400, derandomize=True, deadline=None)
@hypothesis.given(text=_TEXT)
@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.timeout(120)
def test_every_parser_survives_any_text(name: str, text: str) -> None:
    parser = make_parser(name)
    calls = parser.parse(text)
    assert isinstance(calls, list) and all(_well_formed(c) for c in calls), calls
    assert isinstance(parser.needs_more(text), bool)


def _nested_call(parser: str, depth: int) -> str:
    """A call to the calculator whose ``expression`` is a list nested ``depth`` deep."""
    name_key = "arguments" if parser == "hermes" else "parameters"
    call = f'{{"name": "calculator", "{name_key}": {{"expression": {"[" * depth + "]" * depth}}}}}'
    return f"<tool_call>{call}</tool_call>" if parser == "hermes" else call


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_every_call_a_parser_takes_reaches_the_tool_over_http(parser: str) -> None:
    """The deepest-nested call a parser takes goes through the tool server's HTTP client.
    Calls nested a few levels short of the recursion limit parsed, then failed to encode in
    the client's deeper stack (the request wraps the arguments in three more levels): some
    as an error result, and some (980 deep, from a shallower caller) past the client's own
    check, in httpx's encoder: a ToolTransportError, which ends the episode as
    ``tool_error``, never trained on, so a policy could take any episode out of training (its
    penalty with it) by writing one. Past MAX_JSON_DEPTH a call is now the model's error, as
    NaN is."""
    lo, hi = 1, 1000  # the parser takes depth lo, and not hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        (call,) = make_parser(parser).parse(_nested_call(parser, mid))
        lo, hi = (mid, hi) if call.error is None else (lo, mid)
    (deepest,) = make_parser(parser).parse(_nested_call(parser, lo))

    async def through_http() -> ToolResult:
        async with serving(create_app(ToolRegistry([calculator]))) as url:
            tools = HttpTools(url)
            try:
                return await tools.call("t0", deepest.name, deepest.arguments)
            finally:
                await tools.close()

    result = asyncio.run(through_http())
    assert result.error and "'expression' must be of type string" in result.text
    (past,) = make_parser(parser).parse(_nested_call(parser, hi))
    assert past.error is not None and f"past the {MAX_JSON_DEPTH} levels" in past.error
