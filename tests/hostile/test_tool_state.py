"""A trajectory's tool state (a sandbox's files, a counter) lives as long as its trajectory, no
longer: a state created after its trajectory's release was never released, and a ``create``
that never returned held its call past the tool timeout, for ever.

An OpenAI-endpoint harness that returned while calls it started with ``run_tool`` were still
running (an agent framework's own timeout, abandoning them): a call that waited for the
trajectory's tool slot (``agent.max_parallel_tool_calls``) entered the tools after the
episode had released its state, made it afresh, and nothing released it again (in process,
it lived until the run's end). Such a call now releases what it made."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from jax_agent_rl.agent import openai_endpoint
from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.openai_endpoint import HarnessTask
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    Tokenizer,
)
from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser
from jax_agent_rl.tools.base import Tool, ToolResult, function_schema
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry


def _held() -> str:
    """Runs after a slow start."""
    return ""


class _HeldCreate(Tool):
    """A tool whose ``create`` waits for ``go`` (a container starting, say); ``live`` holds the
    states created and not yet released."""

    def __init__(self) -> None:
        self.name = "held"
        self.schema = function_schema(_held)
        self.creating, self.go = asyncio.Event(), asyncio.Event()
        self.live: set[str] = set()

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> str:
        del create_kwargs
        self.creating.set()
        await self.go.wait()
        self.live.add(trajectory_id)
        return trajectory_id

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del arguments
        return ToolResult(f"ran on {state}")

    async def release(self, state: Any) -> None:
        self.live.discard(state)


def test_state_created_after_its_trajectory_was_released_is_released_too() -> None:
    """A release that crosses a call still creating its state (a client that gave up on the
    call, as the tool server's callers do at an episode's timeout, while the server ran it on)
    found no state to release; the state was then created into a trajectory no longer open and
    held for the rest of the server's life, closing it included."""

    async def crossed() -> tuple[ToolResult, set[str], set[str]]:
        t = _HeldCreate()
        tools = LocalTools(ToolRegistry([t]))
        call = asyncio.ensure_future(tools.call("a", "held", {}))
        await t.creating.wait()
        await tools.release("a")
        t.go.set()
        result = await call
        after_call = set(t.live)
        again = await tools.call("a", "held", {})  # the id's next call starts fresh, as usual
        assert again == ToolResult("ran on a")
        await tools.close()
        return result, after_call, t.live

    result, after_call, after_close = asyncio.run(crossed())
    assert result.error and "was released while this call created its state" in result.text
    assert after_call == set() and after_close == set()


def test_a_state_whose_creation_never_ends_fails_the_call_at_its_timeout() -> None:
    """The tool timeout bounded ``execute`` only: a ``create`` waiting on a service that never
    answers held its call, so its episode and the step gathering it, for ever (the test
    bounds it at 30 s). It is the call's error result at the timeout now; the trajectory's
    next call tries again."""

    async def stuck() -> tuple[ToolResult, ToolResult, set[str]]:
        t = _HeldCreate()  # its create waits for `go`, which this test sets only at the end
        tools = LocalTools(ToolRegistry([t]), timeout_s=0.01)
        first = await asyncio.wait_for(tools.call("a", "held", {}), 30)
        t.go.set()
        second = await asyncio.wait_for(tools.call("a", "held", {}), 30)
        await tools.close()
        return first, second, t.live

    first, second, live = asyncio.run(stuck())
    assert first == ToolResult("error: held timed out after 0.01s", error=True)
    assert second == ToolResult("ran on a") and live == set()


HERE = "tests.hostile.test_tool_state"


BOUND_S = 30.0  # how long a wait on another thread's event may take (the test fails past it)


_HELD: dict[str, Any] = {}  # the gated tool's events: entered (a thread's), gate (the test's loop)


_CANCELLED: list[str] = []  # the gated calls cancelled


_LEFT: list[asyncio.Future[str]] = []  # the calls the abandoning harness left (in its loop)


class Gated(Tool):
    """A stateful tool whose calls wait for ``_HELD["gate"]`` (``_HELD["entered"]``: one has)."""

    def __init__(self) -> None:
        self.name = "gated"
        self.schema = {
            "type": "function",
            "function": {
                "name": "gated",
                "description": "Waits for the test.",
                "parameters": {"type": "object", "properties": {}},
            },
        }

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> str:
        del create_kwargs
        return trajectory_id

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del arguments
        _HELD["entered"].set()
        try:
            await _HELD["gate"].wait()
        except asyncio.CancelledError:
            _CANCELLED.append(state)
            raise
        return ToolResult(f"ran for {state}")


async def abandoning(task: HarnessTask) -> None:
    """A harness that starts two of the run's tool calls, and returns once one is running."""
    for i in range(2):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "gated", "arguments": "{}"}}
        _LEFT.append(asyncio.ensure_future(task.run_tool(call)))
    # (the other waits for the trajectory's one tool slot)
    assert await asyncio.to_thread(_HELD["entered"].wait, BOUND_S)


def test_a_tool_call_a_harness_left_running_releases_the_state_it_made(
    tokenizer: Tokenizer, backend: EmbeddedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls the harness left are cancelled as its event loop closes (its tasks are), and
    the state the running one made is released with the episode's. (The backend here never
    samples a turn: the harness's calls are taken as the model's, which `run_tool` otherwise
    checks, `tests/hostile/test_openai_endpoint.py`.)"""
    made = lambda _session, call: ParsedCall(call["function"]["name"], {})  # noqa: E731
    monkeypatch.setattr(openai_endpoint.Session, "_made", made)
    tools = LocalTools(ToolRegistry([Gated()]))
    config = AgentConfig(harness=f"{HERE}:abandoning", max_parallel_tool_calls=1)

    async def go() -> tuple[Trajectory, int]:
        _HELD.update(entered=threading.Event(), gate=asyncio.Event())
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), config)
        sample = Sample(
            "h-0", [{"role": "user", "content": "2+2?"}], "4", agent_name="openai_agent"
        )
        traj = await run_sample(sample, ctx)
        _HELD["gate"].set()  # (nothing waits on it any more)
        return traj, tools.open_trajectories

    _CANCELLED.clear()
    try:
        traj, still_open = asyncio.run(go())
    finally:
        _LEFT.clear()
    assert traj.stop_reason == "harness_error"  # (it never called the endpoint)
    assert _CANCELLED == ["h-0"]  # the running call; the waiting one never ran
    assert still_open == 0
