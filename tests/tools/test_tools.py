"""Tool schemas from type hints and docstrings, argument checking, state per trajectory, and
the calculator."""

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from jax_agent_rl.tools.base import FairPool, Tool, ToolResult, tool
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


def test_a_schema_override_is_the_registrys_own(tmp_path: Path) -> None:
    """A tools file that gives a module's tool instance a schema of its own (the demo's
    shortened calculator) changes that registry's tool only: the instance every other registry
    of the process holds keeps its schema and calls through as before; what a caller does to
    the schemas it was given is not the registry's."""
    before = json.dumps(calculator.schema)
    path = tmp_path / "tools.yaml"
    path.write_text(
        "- class: jax_agent_rl.tools.calculator:calculator\n"
        "  schema: {type: function, function: {name: calc, description: Short.,"
        " parameters: {type: object, properties: {expression: {type: string}}}}}\n"
    )
    short = ToolRegistry.from_yaml(path)
    assert json.dumps(calculator.schema) == before and calculator.name == "calculator"
    assert short.names == ["calc"]
    assert short.schemas()[0]["function"]["description"] == "Short."
    assert ToolRegistry([calculator]).schemas() == [json.loads(before)]
    call = short.get("calc").execute(None, {"expression": "6 * 7"})
    assert asyncio.run(call).text == "42"
    given = short.schemas()
    given[0]["function"]["description"] = "changed by a caller"
    assert short.schemas()[0]["function"]["description"] == "Short."


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


# --- calls sharing a few resources (FairPool, CallClock) -------------------------------------


class Desks(Tool):
    """A tool whose calls share ``size`` desks as the sandbox's calls share its workers (a
    `FairPool` keyed by trajectory): a call holds a desk until the test opens its gate."""

    name = "desk"
    schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "desk",
            "description": "Work at a desk.",
            "parameters": {
                "type": "object",
                "properties": {"call": {"type": "string"}},
                "required": ["call"],
            },
        },
    }

    def __init__(self, size: int) -> None:
        self.pool = FairPool(range(size))
        self.started: list[str] = []  # the calls, in the order they got a desk
        self.gates: dict[str, asyncio.Event] = {}

    def open(self, *calls: str) -> None:
        for call in calls:
            self.gates.setdefault(call, asyncio.Event()).set()

    async def create(self, trajectory_id: str) -> str:
        return trajectory_id

    async def execute(self, state: str, arguments: dict[str, Any]) -> ToolResult:
        call = arguments["call"]
        desk = await self.pool.acquire(state)
        try:
            self.started.append(call)
            await self.gates.setdefault(call, asyncio.Event()).wait()
            return ToolResult(call)
        finally:
            self.pool.release(state, desk)


async def until(condition: Callable[[], bool]) -> None:
    """Lets the other tasks run until ``condition`` holds (the timeout only stops a hang)."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0)


def test_a_trajectory_s_backlog_does_not_hold_up_a_sibling() -> None:
    """Trajectory a takes both desks and queues four more calls; b's one call, queued after
    them, gets the first desk freed (b holds none, a one), not the last."""
    desks = Desks(2)
    tools = LocalTools(ToolRegistry([desks]))

    async def scenario() -> list[ToolResult]:
        a = [asyncio.create_task(tools.call("a", "desk", {"call": f"a{i}"})) for i in range(6)]
        await until(lambda: desks.pool.waiting == 4)
        b = asyncio.create_task(tools.call("b", "desk", {"call": "b0"}))
        await until(lambda: desks.pool.waiting == 5)
        assert desks.started == ["a0", "a1"]
        desks.open("a0")
        await until(lambda: len(desks.started) == 3)
        desks.open(*(f"a{i}" for i in range(1, 6)), "b0")
        return await asyncio.gather(*a, b)

    results = asyncio.run(scenario())
    assert desks.started == ["a0", "a1", "b0", "a2", "a3", "a4", "a5"]
    assert [r.text for r in results] == ["a0", "a1", "a2", "a3", "a4", "a5", "b0"]


def test_turns_go_round_the_trajectories() -> None:
    """One desk: after each call, the desk goes to the waiting trajectory served longest ago
    (among those never served, the first to arrive), so b and c need not wait for all of a."""
    desks = Desks(1)
    tools = LocalTools(ToolRegistry([desks]))
    order = ["a0", "a1", "a2", "a3", "b0", "c0"]

    async def scenario() -> None:
        calls = [tools.call(c[0], "desk", {"call": c}) for c in order]
        tasks = [asyncio.create_task(c) for c in calls]
        await until(lambda: desks.pool.waiting == 5)
        desks.open(*order)
        assert [r.text for r in await asyncio.gather(*tasks)] == order

    asyncio.run(scenario())
    assert desks.started == ["a0", "b0", "c0", "a1", "a2", "a3"]


def test_a_call_is_timed_from_when_it_gets_its_turn() -> None:
    """The executor's timeout counts from when the call gets a desk: waiting its turn longer
    than ``timeout_s`` is no timeout. A wait past ``max_wait_s`` ends the call unrun."""
    desks = Desks(1)
    tools = LocalTools(ToolRegistry([desks]), timeout_s=0.05, max_wait_s=60.0)
    impatient = LocalTools(ToolRegistry([desks]), timeout_s=60.0, max_wait_s=0.05)

    async def scenario() -> tuple[ToolResult, ToolResult, ToolResult]:
        held = await desks.pool.acquire("holder")
        desks.open("waits", "gives up")
        waits = asyncio.create_task(tools.call("a", "desk", {"call": "waits"}))
        await until(lambda: desks.pool.waiting == 1)
        await asyncio.sleep(0.2)  # at least four times its timeout_s, waiting its turn
        desks.pool.release("holder", held)
        ran = await waits
        held = await desks.pool.acquire("holder")
        gave_up = await impatient.call("b", "desk", {"call": "gives up"})
        desks.pool.release("holder", held)
        slow = await tools.call("c", "desk", {"call": "never opened"})
        return ran, gave_up, slow

    ran, gave_up, slow = asyncio.run(scenario())
    assert ran == ToolResult("waits")
    assert gave_up.error and gave_up.text == (
        "error: desk did not run: it waited over 0.05s for its turn (max_wait_s)"
    )
    assert slow.error and slow.text == "error: desk timed out after 0.05s"  # once it runs
    assert desks.started == ["waits", "never opened"] and desks.pool.waiting == 0


def test_a_pool_serves_calls_of_several_event_loops() -> None:
    """A resource released on one thread goes to a call waiting on another thread's event loop
    (a debug loop: a call from a foreign thread raises there), and one granted to a call whose
    loop closed before it took it comes back to the pool."""
    pool = FairPool(["w"])
    held = asyncio.run(pool.acquire("a"))  # by a loop that has ended since
    waiting = threading.Event()
    got: list[str] = []

    async def other_loop() -> None:
        call = asyncio.ensure_future(pool.acquire("b"))
        await until(lambda: pool.waiting == 1)
        waiting.set()
        got.append(await asyncio.wait_for(call, 60))
        pool.release("b", got[-1])

    other = threading.Thread(target=asyncio.run, args=(other_loop(),), kwargs={"debug": True})
    other.start()
    assert waiting.wait(60)
    pool.release("a", held)  # from this thread, outside any loop
    other.join(60)
    assert got == ["w"]

    # granted to a call whose loop closes before it runs again: the next call gets it
    loop = asyncio.new_event_loop()
    held = asyncio.run(pool.acquire("a"))
    call = loop.create_task(pool.acquire("b"))
    loop.run_until_complete(until(lambda: pool.waiting == 1))
    pool.release("a", held)
    loop.close()
    assert asyncio.run(asyncio.wait_for(pool.acquire("c"), 10)) == "w"
    del call  # (its closed loop never runs it again)
