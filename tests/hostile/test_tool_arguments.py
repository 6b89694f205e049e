"""A model's tool call whose values the schema forbids (a value outside an ``enum``, an array
item of the wrong type, a nested object missing a key or holding one of the wrong type) is
the model's error observation naming the argument, and never reaches the tool: a tool that
trusts its schema would otherwise run on a value it was promised it would not get."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest

from jax_agent_rl.tools.base import FunctionTool, tool
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry

CALLS: list[dict[str, Any]] = []


@tool
def convert(amount: float, unit: Literal["metric", "imperial"], tags: list[str]) -> str:
    """Converts an amount.

    Args:
        amount: How much.
        unit: The unit system.
        tags: Labels.
    """
    CALLS.append({"amount": amount, "unit": unit, "tags": tags})
    return "ok"


def _configure(**options: Any) -> str:
    CALLS.append(options)
    return "ok"


configure = FunctionTool(
    _configure,
    schema={
        "type": "function",
        "function": {
            "name": "configure",
            "description": "Sets options.",
            "parameters": {
                "type": "object",
                "properties": {
                    "opts": {
                        "type": "object",
                        "properties": {
                            "mode": {"type": "string", "enum": ["fast", "safe"]},
                            "level": {"type": "integer"},
                        },
                        "required": ["mode"],
                        "additionalProperties": False,
                    },
                    "flag": {"enum": [1, 2]},
                },
                "required": ["opts"],
            },
        },
    },
)


def _call(name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    tools = LocalTools(ToolRegistry([convert, configure]))

    async def scenario() -> tuple[str, bool]:
        result = await tools.call("t", name, arguments)
        await tools.release("t")
        return result.text, result.error

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("name", "arguments", "problem"),
    [
        ("convert", {"amount": 1.0, "unit": "kelvin", "tags": []}, "'unit' must be one of"),
        ("convert", {"amount": 1.0, "unit": "metric", "tags": ["a", 3]}, "'tags[1]' must be of"),
        ("configure", {"opts": {"level": 1}}, "'opts' misses required key(s) ['mode']"),
        ("configure", {"opts": {"mode": "rm -rf"}}, "'opts.mode' must be one of"),
        ("configure", {"opts": {"mode": "fast", "level": "9"}}, "'opts.level' must be of type"),
        ("configure", {"opts": {"mode": "fast", "x": 1}}, "'opts' has unknown key(s) ['x']"),
        ("configure", {"opts": {"mode": "fast"}, "flag": True}, "'flag' must be one of"),
    ],
)
def test_a_value_the_schema_forbids_is_an_error_observation(
    name: str, arguments: dict[str, Any], problem: str
) -> None:
    CALLS.clear()
    text, error = _call(name, arguments)
    assert error and problem in text, text
    assert CALLS == []  # the tool never ran


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("convert", {"amount": 2, "unit": "imperial", "tags": ["a", "b"]}),
        ("configure", {"opts": {"mode": "safe", "level": 3}, "flag": 2}),
    ],
)
def test_values_the_schema_allows_reach_the_tool(name: str, arguments: dict[str, Any]) -> None:
    CALLS.clear()
    assert _call(name, arguments) == ("ok", False)
    assert len(CALLS) == 1
