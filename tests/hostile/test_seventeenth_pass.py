"""The seventeenth adversarial pass.

- ``llama3_json`` calls whose strings hold an escaped quote (``\\"``): the ``;`` splitter
  took the quote after a backslash as the string's end, so the brackets and separators after
  it counted outside the string. A valid call holding ``s = '"}}'; t = 1`` was split into two
  malformed calls, and two valid calls, the first holding ``"{``, were read as one malformed
  call: the model's well-formed calls were answered as its errors (and counted malformed).
- ``jarl eval`` over held-out rows whose data_source is ``all``, the name of its report's line
  of every source together: their prompts counted twice in that line, their own line lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser
from jax_agent_rl.train.evaluation import EvalInputError, eval_target


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


def test_a_held_out_source_named_all_is_refused_before_the_weights_load(tmp_path: Path) -> None:
    """``jarl eval``'s report has one line per data source and one, ``all``, of every source
    together: the rows of a source named ``all`` were counted in that line twice (once as
    their source's, once as every source's), and their own line was lost. Two prompts of
    ``all`` failing and two of ``b`` succeeding reported 6 prompts and pass@1 = 1/3 over all,
    not 4 and 1/2. Now such a source is refused, naming the row, before anything loads."""
    val = tmp_path / "val.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "1 + 1?"}], "ground_truth": "2", "data_source": s}
        for s in ("b", "all")
    ]
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {tmp_path}\ndata:\n  train: {val}\n  val: {val}\n")
    with pytest.raises(EvalInputError, match=r"data\.val row 'all-1' has data_source 'all'"):
        eval_target(str(config))
