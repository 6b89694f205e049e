"""Tool-call parsers: well-formed calls, reasoning that is not a call, and every malformed kind."""

import pytest

from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser


def test_hermes_calls_and_reasoning() -> None:
    p = make_parser("hermes")
    text = (
        '<think>maybe <tool_call>{"name": "ignored", "arguments": {}}</tool_call></think>'
        'First.\n<tool_call>\n{"name": "calculator", '
        '"arguments": {"expression": "1+2"}}\n</tool_call>'
        '\n<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    )
    assert p.parse(text) == [
        ParsedCall("calculator", {"expression": "1+2"}),
        ParsedCall("search", {"q": "x"}),
    ]
    assert p.parse("no calls here") == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "calculator", "argu', "cut off"),
    ],
)
def test_hermes_malformed(text: str, error: str) -> None:
    (call,) = make_parser("hermes").parse(text)
    assert call.error is not None and error in call.error


def test_llama3_json() -> None:
    p = make_parser("llama3_json")
    text = (
        '<|python_tag|>{"name": "a", "parameters": {"x": "1;2"}}; {"name": "b", "parameters": {}}'
    )
    assert p.parse(text) == [ParsedCall("a", {"x": "1;2"}), ParsedCall("b", {})]
    assert p.parse("The answer is 4.") == []
    (bad,) = p.parse('{"name": "a", "parameters": ')
    assert bad.error is not None


def test_code_block_styles() -> None:
    tag = make_parser("python_tag")
    assert tag.stop_tokens == ("</python>",)
    text = "Let me compute.\n<python>\nprint(2 + 2)\n</python>"
    assert tag.parse(text) == [ParsedCall("python", {"code": "print(2 + 2)"})]
    (cut,) = tag.parse("<python>\nprint(")
    assert cut.error is not None and "cut off" in cut.error
    assert tag.parse("<think><python>x</python></think>no call") == []

    fenced = make_parser("fenced_python")
    assert fenced.needs_more("Compute:\n```")  # stopped at the opening fence
    done = "Compute:\n```python\nprint(1)\n```"
    assert not fenced.needs_more(done)
    assert fenced.parse(done) == [ParsedCall("python", {"code": "print(1)\n"})]


def test_unknown_parser_is_named() -> None:
    with pytest.raises(KeyError, match="unknown tool-call parser 'xml'"):
        make_parser("xml")
