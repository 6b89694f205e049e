"""A trajectory's tool state (a sandbox's files, a counter) lives as long as its trajectory, no
longer: a state created after its trajectory's release was never released, and a ``create``
that never returned held its call past the tool timeout, for ever."""

from __future__ import annotations

import asyncio
from typing import Any

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
