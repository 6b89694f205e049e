"""The seventeenth adversarial pass.

- ``llama3_json`` calls whose strings hold an escaped quote (``\\"``): the ``;`` splitter
  took the quote after a backslash as the string's end, so the brackets and separators after
  it counted outside the string. A valid call holding ``s = '"}}'; t = 1`` was split into two
  malformed calls, and two valid calls, the first holding ``"{``, were read as one malformed
  call: the model's well-formed calls were answered as its errors (and counted malformed)."""

from __future__ import annotations

import json

import pytest

from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser


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
