"""Tool schemas from type hints and docstrings, argument checking, state per trajectory, and
the calculator."""

import asyncio
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from jax_agent_rl.tools.base import Tool, ToolResult, tool
from jax_agent_rl.tools.calculator import calculator, evaluate
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry


@tool
def lookup(city: str, year: int, units: Literal["metric", "imperial"] = "metric") -> str:
    """Look up the weather of a city.

    Args:
        city: The city's name.
        year: A year, e.g. 2024.
        units: Unit system of the answer.
    """
    return f"{city}/{year}/{units}"


def test_schema_from_hints_and_docstring() -> None:
    fn = lookup.schema["function"]
    assert fn["name"] == "lookup"
    assert fn["description"] == "Look up the weather of a city."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "The city's name."}
    assert props["year"]["type"] == "integer"
    assert props["units"]["enum"] == ["metric", "imperial"]
    assert fn["parameters"]["required"] == ["city", "year"]


def test_schema_needs_hints_and_description() -> None:
    def no_hint(x):  # type: ignore[no-untyped-def]
        """Does something."""

    def no_doc(x: int) -> int:
        return x

    with pytest.raises(TypeError, match="needs a type hint"):
        tool(no_hint)
    with pytest.raises(TypeError, match="must describe the tool"):
        tool(no_doc)


class Counter(Tool):
    """A stateful tool: counts its calls per trajectory; records creates and releases."""

    name = "count"
    schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "count",
            "description": "Count.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }

    def __init__(self) -> None:
        self.created: list[str] = []
        self.released: list[dict[str, Any]] = []

    async def create(self, trajectory_id: str) -> dict[str, Any]:
        self.created.append(trajectory_id)
        return {"id": trajectory_id, "n": 0}

    async def execute(self, state: dict[str, Any], arguments: dict[str, Any]) -> ToolResult:
        del arguments
        state["n"] += 1
        return ToolResult(str(state["n"]), reward=0.5)

    async def release(self, state: dict[str, Any]) -> None:
        self.released.append(state)


@tool
def crash(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    del x
    raise RuntimeError("boom")


@tool
async def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "done"


def test_local_tools_state_errors_and_release() -> None:
    counter = Counter()
    tools = LocalTools(ToolRegistry([counter, lookup, crash, slow, calculator]), timeout_s=0.2)

    async def scenario() -> list[ToolResult]:
        out = [await tools.call("a", "count", {}) for _ in range(3)]
        out.append(await tools.call("b", "count", {}))
        out.append(await tools.call("a", "lookup", {"city": "Oslo", "year": "2024"}))
        out.append(await tools.call("a", "lookup", {"city": "Oslo", "year": 2024, "extra": 1}))
        out.append(await tools.call("a", "nope", {}))
        out.append(await tools.call("a", "crash", {"x": 1}))
        out.append(await tools.call("a", "slow", {"seconds": 5.0}))
        out.append(await tools.call("a", "lookup", ["not", "an", "object"]))
        await tools.release("a")
        await tools.release("b")
        return out

    r = asyncio.run(scenario())
    assert [x.text for x in r[:4]] == ["1", "2", "3", "1"]  # state lives per trajectory
    assert r[0].reward == 0.5
    assert "argument 'year' must be of type integer" in r[4].text and r[4].error
    assert "unknown argument(s) ['extra']" in r[5].text
    assert "unknown tool 'nope'" in r[6].text
    assert "RuntimeError: boom" in r[7].text
    assert "timed out" in r[8].text
    assert "must be a JSON object" in r[9].text
    assert counter.created == ["a", "b"]
    assert sorted(s["id"] for s in counter.released) == ["a", "b"]
    assert tools.open_trajectories == 0


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(17 + 25) * 3", 126),
        ("2 ** 10", 1024),
        ("7 / 2", 3.5),
        ("-3 + 4 * -2", -11),
        ("sqrt(16)", 4.0),
        ("10 // 3 + 10 % 3", 4),
    ],
)
def test_calculator_values(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("1 / 0", "division by zero"),
        ("2 ** 100000", "exponent"),
        ("9" * 1200, "longer than"),
        ("1 +", "not an arithmetic expression"),
        ("x + 1", "unsupported syntax"),
    ],
)
def test_calculator_refuses(expression: str, message: str) -> None:
    result = asyncio.run(calculator.execute(None, {"expression": expression}))
    assert result.error and message in result.text


def test_tools_yaml(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(
        "- class: jax_agent_rl.tools.calculator:calculator\n"
        "- class: tests.tools.test_tools:Counter\n"
    )
    assert ToolRegistry.from_yaml(path).names == ["calculator", "count"]
    path.write_text("- clas: x\n")
    with pytest.raises(ValueError, match="unknown \\['clas'\\]"):
        ToolRegistry.from_yaml(path)


def test_bm25_search(tmp_path: Path) -> None:
    from jax_agent_rl.tools.search import SearchTool

    corpus = tmp_path / "corpus.jsonl"
    docs = [
        {"id": 1, "title": "Paris", "text": "Paris is the capital of France."},
        {"id": 2, "title": "Berlin", "text": "Berlin is the capital of Germany."},
        {"id": 3, "title": "Rivers", "text": "The Seine flows through Paris."},
    ]
    corpus.write_text("\n".join(json.dumps(d) for d in docs))
    search = SearchTool(str(corpus), k=2)
    assert search.schema["function"]["name"] == "search"
    assert next(d["id"] for d in search.top("capital of Germany")) == 2
    result = asyncio.run(search.execute(None, {"query": "Seine river Paris"}))
    assert result.text.startswith("[1] Rivers: The Seine") and "[2] Paris" in result.text
    assert asyncio.run(search.execute(None, {"query": "quantum"})).text == "no results"
    with pytest.raises(ValueError, match="no 'text' field"):
        SearchTool([{"title": "x"}])
