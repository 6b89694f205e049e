"""Tool-call parsers against text a policy may write to crash them: every parser returns calls
(or what was wrong with them) for any text, and never raises.

Found so: ``1e999`` in a tool call reached tools as ``inf`` (it is the model's error, as
infinity is). ``llama3_json`` calls whose strings hold an escaped quote (``\\"``): the ``;``
splitter took the quote after a backslash as the string's end, so the brackets and separators
after it counted outside the string. A valid call holding ``s = '"}}'; t = 1`` was split into
two malformed calls, and two valid calls, the first holding ``"{``, were read as one malformed
call: the model's well-formed calls were answered as its errors (and counted malformed). Kept
as a regression: text made of JSON's and the tags' pieces parses to strict JSON or an error."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    "values",
    [
        [{"code": "s = '\"}}'; t = 1"}],  # a quote, then closing brackets, then a ';'
        [{"x": '"{'}, {}],  # an opening bracket after an escaped quote hid the ';'
        [{"x": '\\"'}, {"y": "a;b"}],  # an escaped backslash before a real closing quote
        [{"x": '\\\\\\"]'}, {"y": '"];{'}],
    ],
)
def test_llama3_calls_holding_escaped_quotes_are_read_as_written(
    values: list[dict[str, str]],
) -> None:
    calls = [{"name": f"f{i}", "parameters": v} for i, v in enumerate(values)]
    text = "<|python_tag|>" + "; ".join(json.dumps(c) for c in calls)
    parsed = make_parser("llama3_json").parse(text)
    assert parsed == [ParsedCall(c["name"], c["parameters"]) for c in calls]
