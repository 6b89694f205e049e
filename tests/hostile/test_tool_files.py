"""A tools file's schema override written for another function than the tool's: each call the
model makes through it would fail on its arguments (an error the model reads, none the user
sees), so the file is refused where it loads, naming the entry and what does not fit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jax_agent_rl.tools.registry import ToolRegistry

ENTRY = """- class: jax_agent_rl.tools.calculator:calculator
  schema:
    type: function
    function:
      name: calc
      description: Arithmetic.
      parameters: {{type: object, properties: {properties}, required: {required}}}
"""


@pytest.mark.parametrize(
    ("properties", "required", "problem"),
    [
        # a parameter renamed: the function's own is missing from every call
        ("{expr: {type: string}}", "[expr]", "missing a required argument: 'expression'"),
        # a parameter the function does not take
        (
            "{expression: {type: string}, precision: {type: integer}}",
            "[expression]",
            "unexpected keyword argument 'precision'",
        ),
        ("{}", "[]", "missing a required argument: 'expression'"),
    ],
)
def test_a_schema_override_that_does_not_fit_the_function_is_refused(
    tmp_path: Path, properties: str, required: str, problem: str
) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(ENTRY.format(properties=properties, required=required))
    with pytest.raises(ValueError) as e:
        ToolRegistry.from_yaml(path)
    message = str(e.value)
    assert message.startswith(f"{path}: entry 0: schema: its parameters") and problem in message


def test_a_schema_override_that_fits_the_function_is_taken(tmp_path: Path) -> None:
    """Fitting: the function's parameter, described anew (required or not in the schema)."""
    path = tmp_path / "tools.yaml"
    path.write_text(ENTRY.format(properties="{expression: {type: string}}", required="[]"))
    calc = ToolRegistry.from_yaml(path).get("calc")
    assert asyncio.run(calc.execute(None, {"expression": "6 * 7"})).text == "42"
