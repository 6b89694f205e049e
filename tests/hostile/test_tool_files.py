"""A tools file's schema override written for another function than the tool's: each call the
model makes through it would fail on its arguments (an error the model reads, none the user
sees), so the file is refused where it loads, naming the entry and what does not fit.

A tools file's python sandbox set past what its waits and limits take (``timeout_s: 1e300``,
``.inf``, ``.nan``; ``cpu_s: 2.5``; ``memory_mb: 1e13``) was taken, then every execution
failed, each the model's error naming no setting (a poll's OverflowError, the zygote's
TypeError traceback) or the sandbox did not start; ``pool_size: 0`` was concurrent.futures'
error. Each is now a ValueError naming the file, the entry and the setting."""

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


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("timeout_s: 1.0e300", "timeout_s=1e+300: expected in (0, 1e+06]"),
        ("timeout_s: .inf", "timeout_s=inf: expected in (0, 1e+06]"),
        ("timeout_s: .nan", "timeout_s=nan: expected in (0, 1e+06]"),
        ("timeout_s: x", "timeout_s='x': expected in (0, 1e+06]"),
        ("cpu_s: 2.5", "cpu_s=2.5: expected a whole number in [1, 1e9]"),
        ("cpu_s: 0", "cpu_s=0: expected a whole number in [1, 1e9]"),
        ("memory_mb: 10000000000000", "memory_mb=10000000000000: expected a whole number in"),
        ("pool_size: 0", "pool_size=0: expected a whole number >= 1"),
    ],
)
def test_a_sandbox_set_past_what_it_takes_is_refused_naming_the_setting(
    tmp_path: Path, setting: str, problem: str
) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(f"- class: jax_agent_rl.tools.sandbox:PythonTool\n  config:\n    {setting}\n")
    with pytest.raises(ValueError) as refused:
        ToolRegistry.from_yaml(path)
    assert str(refused.value).startswith(f"{path}: entry 0: config: the python sandbox's {problem}")
