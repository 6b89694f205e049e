"""A synchronous tool that never returns on some input (a service that never answers, a
pathological expression), which a policy finds and calls again and again: each call ends at
its timeout as an error result, and the threads left running inside the function (a thread
cannot be stopped) hold the tools' own bounded pool, never the event loop's default executor,
which the learner's steps and the judge wait on.

Every wait is on an event, bounded; no test reads the clock."""

from __future__ import annotations

import asyncio
import threading

from jax_agent_rl.tools.base import tool
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry

BOUND_S = 30.0  # how long the test waits for work on the default executor (it fails past it)
RELEASE = threading.Event()


@tool
def lookup(query: str) -> str:
    """Look a query up in a service that never answers.

    Args:
        query: what to look up.
    """
    del query
    RELEASE.wait(2 * BOUND_S)  # (the test releases it at its end)
    return "found"


def test_stuck_tool_calls_leave_the_default_executor_to_the_rest_of_the_run() -> None:
    """40 stuck calls (more than any default executor's 32 threads) time out as error results;
    then work sent to the default executor still runs (before: it waited for ever)."""

    async def go() -> tuple[list[str], str]:
        tools = LocalTools(ToolRegistry([lookup]), timeout_s=0.01)
        calls = [tools.call(f"t{i}", "lookup", {"query": "x"}) for i in range(40)]
        results = [r.text for r in await asyncio.gather(*calls)]
        ran = await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), BOUND_S)
        return results, ran

    try:
        results, ran = asyncio.run(go())
        assert results == ["error: lookup timed out after 0.01s"] * 40
        assert ran == "ran"
    finally:
        RELEASE.set()  # the stuck threads return, and end
