"""An unexpected error in one trajectory (a custom loop, a tool executor, a parser) ends that
trajectory only, with stop reason ``agent_error`` and its traceback: the trajectories gathered
beside it finish exactly as they would alone, its tool state is released, the trace record and
the metrics show it, and only a rollout where every trajectory failed stops the trainer.

Runs on the real embedded engine with the tiny model `tests.agent.test_loop` memorises (its
``setup`` fixture, chatml style only).
"""

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from jax_agent_rl.agent.loop import (
    AGENT_LOOPS,
    AgentContext,
    register_agent_loop,
    run_sample,
)
from jax_agent_rl.agent.parsers import HermesParser, ParsedCall
from jax_agent_rl.agent.trajectory import Sample, Trajectory
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.episodes import episode_metrics, raise_if_all_failed
from jax_agent_rl.train.traces import render_trace, trace_record
from tests.agent.test_loop import CONFIG, echo

CHATML = pytest.mark.parametrize("setup", ["chatml"], indirect=True)
QUESTION = "What is 17 + 25?"  # the model calls the calculator, then answers


class ExecutorBug(LocalTools):
    """An executor that fails with a bug of its own (not a transport failure) after taking
    the trajectory's tool state."""

    async def call(
        self, trajectory_id: str, name: str, arguments: Any, create_kwargs: Any = None
    ) -> ToolResult:
        await super().call(trajectory_id, name, arguments, create_kwargs)
        raise KeyError("executor bug")


class ParserBug(HermesParser):
    def parse(self, text: str) -> list[ParsedCall]:
        del text
        raise ValueError("parser bug")


async def crashing_loop(sample: Sample, ctx: AgentContext) -> Trajectory:
    """A user loop that takes tool state, then fails without releasing it."""
    await ctx.tools.call(sample.uid, "calculator", {"expression": "1 + 1"})
    raise RuntimeError("loop bug")


@pytest.fixture
def crashing_agent() -> Iterator[str]:
    register_agent_loop("crashing", crashing_loop)
    yield "crashing"
    del AGENT_LOOPS["crashing"]


def _tools() -> LocalTools:
    return LocalTools(ToolRegistry([calculator, echo]))


def _rollout(
    setup: dict[str, Any], runs: list[tuple[str, str, LocalTools, HermesParser]]
) -> list[Trajectory]:
    """One gather of ``(uid, agent_name, tools, parser)`` episodes of `QUESTION` on one
    engine backend."""
    backend = EmbeddedBackend(setup["engine"], setup["weights"])

    async def go() -> list[Trajectory]:
        episodes = []
        for uid, agent, tools, parser in runs:
            ctx = await AgentContext.create(backend, setup["tokenizer"], tools, parser, CONFIG)
            sample = Sample(uid, [{"role": "user", "content": QUESTION}], agent_name=agent)
            episodes.append(run_sample(sample, ctx))
        trajs = await asyncio.gather(*episodes)
        await backend.close()
        return list(trajs)

    return asyncio.run(go())


@CHATML
def test_one_failure_does_not_affect_its_siblings(
    setup: dict[str, Any], crashing_agent: str
) -> None:
    tools, broken = _tools(), ExecutorBug(ToolRegistry([calculator, echo]))
    good, loop, executor, parser = _rollout(
        setup,
        [
            ("good", "tool_agent", tools, HermesParser()),
            ("loop", crashing_agent, tools, HermesParser()),
            ("executor", "tool_agent", broken, HermesParser()),
            ("parser", "tool_agent", tools, ParserBug()),
        ],
    )
    assert good.prompt_ids + good.response_ids == setup["expected"][QUESTION][0]
    assert good.stop_reason == "eos" and good.trainable and good.error is None
    failures = {
        "RuntimeError: loop bug": loop,
        "KeyError: 'executor bug'": executor,
        "ValueError: parser bug": parser,
    }
    for message, traj in failures.items():
        assert traj.stop_reason == "agent_error" and not traj.trainable
        assert traj.error is not None and traj.error.startswith("Traceback")
        assert message in traj.error
    # the loop's own failures keep the model turn they sampled; a user loop's, the prompt
    assert executor.response_ids and parser.response_ids and executor.num_turns == 1
    assert loop.response_ids == [] and loop.messages == [{"role": "user", "content": QUESTION}]
    assert tools.open_trajectories == 0 and broken.open_trajectories == 0
    metrics = episode_metrics([good, loop, executor, parser])
    assert metrics["stop/agent_error"] == 0.75 and metrics["untrainable"] == 0.75
    raise_if_all_failed([good, loop, executor, parser])  # a working sibling: no raise


@CHATML
def test_trace_record_carries_the_traceback(setup: dict[str, Any]) -> None:
    (traj,) = _rollout(setup, [("parser", "tool_agent", _tools(), ParserBug())])
    record = json.loads(json.dumps(trace_record(traj, setup["tokenizer"], step=3)))
    assert record["stop_reason"] == "agent_error"
    assert record["error"] == traj.error and "ValueError: parser bug" in record["error"]
    console = Console(record=True, width=100, color_system="standard")
    render_trace(record, console)
    out = console.export_text()
    assert "stop agent_error" in out
    assert "Traceback (most recent call last)" in out and "ValueError: parser bug" in out


@CHATML
def test_a_rollout_where_every_trajectory_failed_raises(
    setup: dict[str, Any], crashing_agent: str
) -> None:
    runs = [(f"crash-{i}", crashing_agent, _tools(), HermesParser()) for i in range(2)]
    trajs = _rollout(setup, runs)
    with pytest.raises(RuntimeError, match="all 2 trajectories of the rollout failed") as e:
        raise_if_all_failed(trajs)
    assert "RuntimeError: loop bug" in str(e.value)


@CHATML
def test_cancellation_is_not_a_trajectory_error(setup: dict[str, Any]) -> None:
    """Cancelling a rollout cancels its trajectories; none is turned into agent_error."""
    started = asyncio.Event()

    async def waiting_loop(sample: Sample, ctx: AgentContext) -> Trajectory:
        del sample, ctx
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("never reached")

    async def go() -> None:
        backend = EmbeddedBackend(setup["engine"], setup["weights"])
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], _tools(), HermesParser(), CONFIG
        )
        sample = Sample("waits", [{"role": "user", "content": QUESTION}], agent_name="waits")
        task = asyncio.create_task(run_sample(sample, ctx))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await backend.close()

    register_agent_loop("waits", waiting_loop)
    try:
        asyncio.run(go())
    finally:
        del AGENT_LOOPS["waits"]
