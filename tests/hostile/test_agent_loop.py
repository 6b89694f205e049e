"""An unexpected error in one trajectory (a custom loop, a tool executor, a parser) ends that
trajectory only, with stop reason ``agent_error`` and its traceback: the trajectories gathered
beside it finish exactly as they would alone, its tool state is released, the trace record and
the metrics show it, and only a rollout where every trajectory failed stops the trainer.

Nor does a trajectory that floods the tools starve its siblings: a turn of many calls runs at
most ``agent.max_parallel_tool_calls`` of them at once and ``agent.max_tool_calls_per_turn`` in
all (each later call is answered with an error naming the cap), the sandbox pool takes turns by
trajectory, and a call's timeout counts from when it gets a worker, not while it queues.

Runs on the real embedded engine with the tiny model `tests.agent.test_loop` memorises (its
``setup`` fixture, chatml style only).
"""

import asyncio
import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
from rich.console import Console

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.loop import AGENT_LOOPS, finish_turn, register_agent_loop, run_sample
from jax_agent_rl.agent.trajectory import StopReason, Trajectory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization.tool_calls import HermesParser, ParsedCall
from jax_agent_rl.tools.base import Tool, ToolExecutor, ToolResult, tool
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.sandbox import Limits, PythonSandbox, PythonTool
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
    episodes = [Episode(t) for t in (good, loop, executor, parser)]
    metrics = episode_metrics(episodes)
    assert metrics["stop/agent_error"] == 0.75 and metrics["untrainable"] == 0.75
    raise_if_all_failed(episodes)  # a working sibling: no raise


@CHATML
def test_trace_record_carries_the_traceback(setup: dict[str, Any]) -> None:
    (traj,) = _rollout(setup, [("parser", "tool_agent", _tools(), ParserBug())])
    record = json.loads(json.dumps(trace_record(Episode(traj), setup["tokenizer"], step=3)))
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
        raise_if_all_failed([Episode(t) for t in trajs])
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


# --- one trajectory's tool calls do not starve its siblings' ---------------------------------


async def _until(condition: Callable[[], bool]) -> None:
    """Lets the other tasks run until ``condition`` holds (the timeout only stops a hang)."""
    async with asyncio.timeout(120):
        while not condition():
            await asyncio.sleep(0)


async def _context(
    setup: dict[str, Any], tools: ToolExecutor, config: AgentConfig = CONFIG
) -> AgentContext:
    backend = EmbeddedBackend(setup["engine"], setup["weights"])  # never asked: turns are given
    ctx = await AgentContext.create(backend, setup["tokenizer"], tools, HermesParser(), config)
    await backend.close()
    return ctx


def _turn_of_calls(
    ctx: AgentContext, uid: str, calls: list[tuple[str, dict[str, Any]]]
) -> tuple[Trajectory, list[int]]:
    """A trajectory whose model just wrote one turn of ``calls`` (chatml's hermes format)."""
    text = "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
        for name, args in calls
    )
    turn = [*ctx.tokenizer.encode(text), ctx.builder.eos_id]
    user = [{"role": "user", "content": QUESTION}]
    traj = Trajectory(uid=uid, group_id=uid, prompt_ids=ctx.builder.prompt_ids(user))
    traj.timings["tools_s"] = 0.0  # as `run_episode` starts it
    traj.append(turn, model=True)
    return traj, turn


def _tool_texts(traj: Trajectory) -> list[str]:
    return [m["content"] for m in traj.messages if m["role"] == "tool"]


class Gate(Tool):
    """Counts each trajectory's calls in flight; every call waits until the gate opens."""

    name = "gate"
    schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "gate",
            "description": "Wait at the gate.",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
            },
        },
    }

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.most: Counter[str] = Counter()  # the most in flight at once, per trajectory
        self.opened = asyncio.Event()

    async def create(self, trajectory_id: str) -> str:
        return trajectory_id

    async def execute(self, state: str, arguments: dict[str, Any]) -> ToolResult:
        self.in_flight[state] += 1
        self.most[state] = max(self.most[state], self.in_flight[state])
        try:
            await self.opened.wait()
            return ToolResult(str(arguments["n"]))
        finally:
            self.in_flight[state] -= 1


@CHATML
@pytest.mark.parametrize("cap", [None, 2])  # None: the default, 4
def test_a_turn_runs_at_most_max_parallel_tool_calls_at_once(
    setup: dict[str, Any], cap: int | None
) -> None:
    """Two trajectories, each with a turn of nine calls (all under the per-turn cap): each runs
    at most its cap of them at once, and its observation still lists the results in the calls'
    order."""
    gate = Gate()
    config = dataclasses.replace(CONFIG, max_tool_calls_per_turn=9)
    if cap is not None:
        config = dataclasses.replace(config, max_parallel_tool_calls=cap)
    expected = 4 if cap is None else cap

    async def go() -> list[Trajectory]:
        ctx = await _context(setup, LocalTools(ToolRegistry([gate])), config)
        turns = [_turn_of_calls(ctx, u, [("gate", {"n": n}) for n in range(9)]) for u in "ab"]
        tasks = [asyncio.create_task(finish_turn(ctx, t, turn, "stop")) for t, turn in turns]
        # every call that may run is in flight (without a cap, all nine of each trajectory)
        await _until(lambda: gate.in_flight.total() >= 2 * expected)
        gate.opened.set()
        assert await asyncio.gather(*tasks) == [None, None]
        return [t for t, _ in turns]

    for traj in asyncio.run(go()):
        assert gate.most[traj.uid] == expected
        assert _tool_texts(traj) == [str(n) for n in range(9)]
        assert traj.tool_calls == 9 and traj.tool_errors == 0


@CHATML
def test_a_turn_runs_at_most_max_tool_calls_per_turn(setup: dict[str, Any]) -> None:
    """A turn of twelve well-formed calls and a malformed one, under the defaults (8 a turn, 4
    at once): the first eight well-formed calls run, at most four at once; the malformed one
    is answered with its error and does not count; each later call is answered with an error
    naming the cap, in the observation (mask 0), counted as refused, not malformed."""
    runs: list[int] = []
    in_flight = Counter[str]()

    @tool
    async def count(n: int) -> str:
        """Count one run.

        Args:
            n: The call's number.
        """
        runs.append(n)
        in_flight["now"] += 1
        in_flight["most"] = max(in_flight["most"], in_flight["now"])
        await asyncio.sleep(0.01)
        in_flight["now"] -= 1
        return f"ran {n}"

    # room for the refusals' whole text, and for the turn's observation
    config = dataclasses.replace(
        CONFIG, max_tool_response_tokens=64, max_response_tokens=8192, max_model_len=16384
    )
    assert (config.max_tool_calls_per_turn, config.max_parallel_tool_calls) == (8, 4)
    calls = [("count", {"n": n}) for n in range(12)]
    calls.insert(3, ("", {}))  # malformed: no name

    async def go() -> tuple[Trajectory, list[int], StopReason | None]:
        ctx = await _context(setup, LocalTools(ToolRegistry([count])), config)
        traj, turn = _turn_of_calls(ctx, "flood", calls)
        return traj, turn, await finish_turn(ctx, traj, turn, "stop")

    traj, turn, stop = asyncio.run(go())
    assert stop is None  # the episode goes on: the model reads the observation
    assert sorted(runs) == list(range(8)) and in_flight["most"] == 4
    refusal = "error: tool call {} of 13 not run: at most 8 tool calls per turn"
    refusals = [refusal.format(i) + " (agent.max_tool_calls_per_turn)" for i in range(10, 14)]
    texts = _tool_texts(traj)
    assert texts[:3] == ["ran 0", "ran 1", "ran 2"] and texts[3].startswith("error: ")
    assert texts[4:9] == [f"ran {n}" for n in range(3, 8)] and texts[9:] == refusals
    assert (traj.tool_calls, traj.tool_errors) == (13, 5)
    assert (traj.malformed_calls, traj.refused_calls) == (1, 4)
    assert traj.turn_kinds == ["call"]
    # the turn is the model's (mask 1); its observation, refusals included, is context (mask 0)
    n, total = len(turn), len(traj.response_ids)
    assert traj.response_ids[:n] == turn and traj.loss_mask == [1] * n + [0] * (total - n)
    observation = setup["tokenizer"].decode(traj.response_ids[n:])
    assert all(r in observation for r in refusals)
    metrics = episode_metrics([Episode(traj)])
    assert metrics["refused_call_rate"] == 4 / 13 and metrics["malformed_call_rate"] == 1 / 13


class WatchedSandbox(PythonSandbox):
    """The real pool, with an event set once more calls reached it than it has workers."""

    def __init__(self, size: int, limits: Limits, timeout_s: float) -> None:
        super().__init__(size, limits, timeout_s)
        self.size, self.calls = size, 0
        self.crowded = asyncio.Event()

    async def run(self, code: str, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > self.size:
            self.crowded.set()
        return await super().run(code, *args, **kwargs)


@CHATML
def test_eight_sleeps_do_not_time_out_a_sibling_s_call(setup: dict[str, Any]) -> None:
    """The finding: one trajectory's turn of eight one-second sleeps on a pool of two
    sandboxes, and a sibling's ``print(6*7)`` issued once the sleeps crowd the pool. The
    sibling gets its turn after at most one sleep and prints 42; no call times out, since each
    runs well within the executor's 3.5 s once it has a worker (2.5 s to spare on a busy
    machine), while the sleeps all queued ahead of it, as before, took 4 s."""
    sandbox = WatchedSandbox(2, Limits(cpu_s=2, memory_mb=128), timeout_s=10.0)
    tools = LocalTools(ToolRegistry([PythonTool(sandbox)]), timeout_s=3.5)
    sleep = {"code": "import time\ntime.sleep(1.0)\nprint('slept')"}

    async def go() -> tuple[Trajectory, Trajectory]:
        ctx = await _context(setup, tools)
        attacker, attack = _turn_of_calls(ctx, "attacker", [("python", sleep)] * 8)
        sibling, ask = _turn_of_calls(ctx, "sibling", [("python", {"code": "print(6*7)"})])
        flood = asyncio.create_task(finish_turn(ctx, attacker, attack, "stop"))
        await sandbox.crowded.wait()  # the sleeps hold both workers, and more wait for one
        await finish_turn(ctx, sibling, ask, "stop")
        await flood
        return attacker, sibling

    try:
        attacker, sibling = asyncio.run(go())
    finally:
        sandbox.close()
    assert _tool_texts(sibling) == ["42"] and sibling.tool_errors == 0
    assert _tool_texts(attacker) == ["slept"] * 8 and attacker.tool_errors == 0


@CHATML
def test_the_sandbox_pool_takes_turns_by_trajectory(setup: dict[str, Any]) -> None:
    """One sandbox, held while trajectory a queues four calls and b one: once it is free, b's
    call runs second, not after all of a's (each call prints when it ran)."""
    sandbox = PythonSandbox(1, Limits(cpu_s=2, memory_mb=128), timeout_s=10.0)
    tools = LocalTools(ToolRegistry([PythonTool(sandbox)]))
    when = {"code": "import time\nprint(time.monotonic_ns())"}

    async def go() -> tuple[Trajectory, Trajectory]:
        # room in an observation for a nanosecond clock reading
        ctx = await _context(setup, tools, dataclasses.replace(CONFIG, max_tool_response_tokens=64))
        a, a_turn = _turn_of_calls(ctx, "a", [("python", when)] * 4)
        b, b_turn = _turn_of_calls(ctx, "b", [("python", when)])
        held = await sandbox.pool.acquire("test")  # the only sandbox: every call below waits
        first = asyncio.create_task(finish_turn(ctx, a, a_turn, "stop"))
        await _until(lambda: sandbox.pool.waiting == 4)
        second = asyncio.create_task(finish_turn(ctx, b, b_turn, "stop"))
        await _until(lambda: sandbox.pool.waiting == 5)
        sandbox.pool.release("test", held)
        await asyncio.gather(first, second)
        return a, b

    try:
        a, b = asyncio.run(go())
    finally:
        sandbox.close()
    ran = sorted([(int(t), "a") for t in _tool_texts(a)] + [(int(t), "b") for t in _tool_texts(b)])
    assert [who for _, who in ran] == ["a", "b", "a", "a", "a"]
