"""The fifteenth adversarial pass.

- An environment's ``async`` method ran on the rollout's event loop: one that blocked its thread
  (a ``time.sleep``, a synchronous client call with no timeout, inside ``async def``) held every
  episode's model turns and the backend while it blocked, and one that never returned hung the
  run, where nothing could stop it. Environments' async calls now run on an event loop of their
  own, in a thread of its own (`jax_agent_rl.envs.env_loop`; one loop for all of them, so a verl
  interaction shared by every episode lives on one loop), awaited from the rollout's loop within
  ``env.step_timeout_s``: the call that blocks ends at its timeout (the policy's, as any step
  past it), the calls it held up end as not the policy's (``env_error``, naming it), and a loop
  blocked for good ends every later episode so, which stops the run with that error.
- A ``react_agent`` graph (``agent.graph``, user code as a harness is) ran on the rollout's
  loop with no deadline: one that awaited for ever held its episode and the step for ever, one
  that blocked its thread held every episode and the backend, and one that raised after a
  model turn (a node parsing the policy's text) ended ``agent_error``, untrained: a policy
  escaped being wrong by writing what the graph choked on. A graph now runs as a harness
  does, in a thread and event loop of its own, its model turns and tool calls on the
  rollout's loop, stopped once it holds its episode ``agent.harness_timeout_s`` without one
  in progress; failing after a live model turn ends ``caused_error`` (trained, outcome 0).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from langgraph.graph import END, START, MessagesState, StateGraph

from jax_agent_rl.agent import episode as played
from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.langgraph_loop import GraphEpisode
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.trajectory import StopReason, Trajectory
from jax_agent_rl.compat.verl.interaction import interaction_factory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, Environments, EnvStep
from jax_agent_rl.envs.base import EnvBusyError, EnvStepError, GuardedEnvironment
from jax_agent_rl.envs.env_loop import THREAD, EnvLoop
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.episodes import raise_if_all_failed
from tests.hostile.test_twelfth_pass import BOUND_S


class Blocking:
    """A native environment whose async step blocks its thread (a synchronous call inside
    ``async def``) until ``release`` is set, saying when it starts (``blocking``) and ends."""

    turns, owns_reward = "all", True

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.blocking, self.woke = threading.Event(), threading.Event()

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        self.blocking.set()
        released = self.release.wait(BOUND_S)
        self.woke.set()
        return EnvStep([], float(released), True)

    async def close(self) -> None:
        pass


class Waiting:
    """A native environment whose async step awaits (without blocking) until ``go`` is set."""

    turns, owns_reward = "all", True

    def __init__(self) -> None:
        self.stepping = threading.Event()

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        self.stepping.set()
        await asyncio.sleep(3 * BOUND_S)  # (cancelled at its timeout)
        return EnvStep([], 1.0, True)

    async def close(self) -> None:
        pass


def _sample(env_class: str, uid: str = "s/0") -> Sample:
    return Sample(uid, [{"role": "user", "content": "go"}], "1", env_class=env_class)


def _made(envs: Environments, env_class: str) -> GuardedEnvironment:
    made = envs.make(_sample(env_class))
    assert isinstance(made, GuardedEnvironment)
    return made


def test_an_async_step_blocking_its_thread_holds_not_the_rollout_loop() -> None:
    """An async step blocked on an event that only a coroutine of the rollout's loop sets: it
    gets it, and answers (before: it held that loop, so the event was never set and the step
    was refused once it gave up waiting, "blocked the event loop")."""
    gate = threading.Event()
    env = Blocking(gate)
    envs = Environments({"b": lambda _: env}, step_timeout_s=BOUND_S, loop=EnvLoop())

    async def go() -> EnvStep:
        made = _made(envs, "b")
        await made.reset(_sample("b"))
        step = asyncio.ensure_future(made.step("move", []))
        await asyncio.to_thread(env.blocking.wait, BOUND_S)  # (the rollout's loop runs on)
        gate.set()
        return await step

    assert asyncio.run(go()) == EnvStep([], 1.0, True)


def test_calls_held_up_by_a_blocked_env_loop_are_not_the_policys() -> None:
    """While one episode's async step blocks the environments' loop: its own step ends at its
    timeout as the policy's (EnvStepError: it holds the loop itself), and another episode's
    step, submitted meanwhile and never started, ends as not the policy's (EnvBusyError),
    naming the call that holds the loop."""
    release = threading.Event()
    blocker, other = Blocking(release), Waiting()
    envs = Environments(
        {"b": lambda _: blocker, "w": lambda _: other}, step_timeout_s=0.5, loop=EnvLoop()
    )

    async def go() -> tuple[BaseException, BaseException]:
        a, b = _made(envs, "b"), _made(envs, "w")
        await a.reset(_sample("b"))
        await b.reset(_sample("w"))
        stepped = asyncio.ensure_future(a.step("move", []))
        await asyncio.to_thread(blocker.blocking.wait, BOUND_S)
        errors = await asyncio.gather(stepped, b.step("move", []), return_exceptions=True)
        return errors[0], errors[1]

    try:
        own, held = asyncio.run(go())
    finally:
        release.set()
        assert blocker.woke.wait(BOUND_S)
    assert isinstance(own, EnvStepError), own
    assert "b.step took longer than env.step_timeout_s=0.5s (it blocks the environments'" in str(
        own
    )
    assert isinstance(held, EnvBusyError), held
    assert "w.step took longer than env.step_timeout_s=0.5s" in str(held)
    assert "never started it: b.step has held it for" in str(held)
    assert not other.stepping.is_set()  # (given up before it started: it never runs)


def test_a_call_stalled_midway_by_another_that_blocks_is_not_the_policys() -> None:
    """An episode's async step that started and awaits, then another episode's step blocks the
    loop for the rest of the first's timeout: the first ends as not the policy's (EnvBusyError:
    other calls held the loop for most of its time), not as a wrong answer."""
    release = threading.Event()
    blocker, waiter = Blocking(release), Waiting()
    # the blocker must take the loop within half the waiter's timeout of its start (this
    # thread's hand-off, milliseconds idle): 3 s of slack for a machine other jobs load
    envs = Environments(
        {"b": lambda _: blocker, "w": lambda _: waiter}, step_timeout_s=6.0, loop=EnvLoop()
    )

    async def go() -> BaseException | EnvStep:
        a, b = _made(envs, "b"), _made(envs, "w")
        await a.reset(_sample("b"))
        await b.reset(_sample("w"))
        waiting = asyncio.ensure_future(b.step("move", []))
        await asyncio.to_thread(waiter.stepping.wait, BOUND_S)
        blocked = asyncio.ensure_future(a.step("move", []))
        out = (await asyncio.gather(waiting, return_exceptions=True))[0]
        await asyncio.gather(blocked, return_exceptions=True)
        return out

    try:
        error = asyncio.run(go())
    finally:
        release.set()
        assert blocker.woke.wait(BOUND_S)
    assert isinstance(error, EnvBusyError), error
    assert "other calls' synchronous code held the environments' event loop" in str(error)


class Leaving:
    """A native environment whose async step answers at once, leaving a task on the loop that
    blocks it (until ``release``)."""

    turns, owns_reward = "all", True

    def __init__(self, release: threading.Event) -> None:
        self.release, self.woke = release, threading.Event()

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages

        async def left() -> None:
            self.release.wait(BOUND_S)
            self.woke.set()

        asyncio.get_running_loop().create_task(left())
        return EnvStep([], 1.0, False)

    async def close(self) -> None:
        pass


def test_a_call_that_answered_is_taken_though_a_task_it_left_blocks_the_loop() -> None:
    """Its answer is taken as its coroutine gives it (not once its task's callbacks run, behind
    the task it left), and a call after it, never started, ends as not the policy's, naming no
    call as holding the loop (before: the task it left held the rollout's loop, every episode
    with it)."""
    release = threading.Event()
    env = Leaving(release)
    envs = Environments({"l": lambda _: env}, step_timeout_s=0.5, loop=EnvLoop())

    async def go() -> tuple[EnvStep, BaseException]:
        a, b = _made(envs, "l"), _made(envs, "l")
        await a.reset(_sample("l"))
        await b.reset(_sample("l"))
        answered = await a.step("move", [])
        held = (await asyncio.gather(b.step("move", []), return_exceptions=True))[0]
        return answered, held

    try:
        answered, held = asyncio.run(go())
    finally:
        release.set()
        assert env.woke.wait(BOUND_S)
    assert answered == EnvStep([], 1.0, False)
    assert isinstance(held, EnvBusyError) and "no call's code holds it now" in str(held)


def test_a_shared_interaction_runs_on_the_environments_loop() -> None:
    """Every episode's calls of the one interaction instance verl shares run on the
    environments' loop thread, one loop for all (before: on the rollout's)."""
    threads: set[str] = set()

    class Recorder:
        async def start_interaction(self, instance_id: str, **_kwargs: object) -> str:
            threads.add(threading.current_thread().name)
            return instance_id

        async def generate_response(
            self, instance_id: str, messages: list[dict], **_kwargs: object
        ) -> tuple[bool, str, float, dict]:
            del instance_id, messages
            threads.add(threading.current_thread().name)
            return True, "ok", 0.0, {}

        async def finalize_interaction(self, instance_id: str, **_kwargs: object) -> None:
            del instance_id
            threads.add(threading.current_thread().name)

    envs = Environments(interaction=interaction_factory({"r": Recorder()}), loop=EnvLoop())

    async def episode(uid: str) -> None:
        sample = Sample(uid, [{"role": "user", "content": "hi"}], "1",
                        extra={"interaction_kwargs": {"name": "r"}})  # fmt: skip
        made = envs.make(sample)
        assert made is not None
        await made.reset(sample)
        await made.step("x", [{"role": "assistant", "content": "x"}])
        await made.close()

    async def go() -> None:
        await asyncio.gather(episode("a/0"), episode("b/0"))

    asyncio.run(go())
    assert threads == {THREAD}


def _episodes(
    backend: EmbeddedBackend, tokenizer: Tokenizer, envs: Environments, blocker: Blocking
) -> list[Trajectory]:
    """One episode of ``blocker`` (its first step blocks the environments' loop for good), then,
    once it blocks, three of another environment."""

    async def go() -> list[Trajectory]:
        tools = LocalTools(ToolRegistry([]))
        cfg = AgentConfig(max_turns=2, max_tokens_per_turn=4, max_model_len=256)
        ctx = await AgentContext.create(
            backend, tokenizer, tools, make_parser("hermes"), cfg, envs=envs
        )
        first = asyncio.ensure_future(run_sample(_sample("b", "b/0"), ctx))
        await asyncio.to_thread(blocker.blocking.wait, BOUND_S)
        rest = [run_sample(_sample("w", f"w/{i}"), ctx) for i in range(3)]
        return list(await asyncio.wait_for(asyncio.gather(first, *rest), 3 * BOUND_S))

    return asyncio.run(go())


def test_an_env_loop_blocked_for_good_stops_the_run_naming_it(
    backend: EmbeddedBackend, tokenizer: Tokenizer
) -> None:
    """An episode whose async step blocks the environments' loop for good (released only when
    the test ends): it ends caused_error at its timeout, every episode started after it ends
    env_error (its reset never started), and the rollout's every-episode-failed error names the
    call holding the loop and the timeout (before: the rollout's loop was held, and with it
    every episode, until the step returned)."""
    release = threading.Event()
    blocker = Blocking(release)
    envs = Environments(
        {"b": lambda _: blocker, "w": lambda _: Waiting()}, step_timeout_s=1.0, loop=EnvLoop()
    )
    try:
        trajs = _episodes(backend, tokenizer, envs, blocker)
    finally:
        release.set()
        assert blocker.woke.wait(BOUND_S)
    assert [t.stop_reason for t in trajs] == ["caused_error", *["env_error"] * 3]
    with pytest.raises(RuntimeError) as failed:
        raise_if_all_failed([played.Episode(t) for t in trajs])
    said = str(failed.value)
    assert "75% of episodes ended env_error" in said, said
    assert "w.reset took longer than env.step_timeout_s=1.0s" in said
    assert "b.step has held it for" in said


def test_an_env_error_stays_an_env_error() -> None:
    """(A guard: the env loop carries an environment's own error through as it is.)"""

    class Raising:
        turns, owns_reward = "all", True

        async def reset(self, sample: Sample) -> list[dict]:
            del sample
            raise SystemExit(3)  # (not an Exception: carried as a RuntimeError naming it)

        async def step(self, text: str, messages: list[dict]) -> EnvStep:
            del text, messages
            raise AssertionError

        async def close(self) -> None:
            pass

    envs = Environments({"r": lambda _: Raising()}, step_timeout_s=BOUND_S, loop=EnvLoop())

    async def go() -> None:
        await _made(envs, "r").reset(_sample("r"))

    with pytest.raises(EnvError, match=r"r.reset raised .*SystemExit"):
        asyncio.run(go())


# react_agent's graphs (agent.graph): user code, as a harness is, now run as a harness runs


def awaiting(model: Any, tools: Any) -> Any:
    """A graph whose node awaits for ever before the model's first turn."""
    del model, tools

    async def node(state: MessagesState) -> dict:
        del state
        await asyncio.Event().wait()
        return {}

    return _one_node(node)


GRAPH_RELEASE, GRAPH_WOKE = threading.Event(), threading.Event()


def blocking(model: Any, tools: Any) -> Any:
    """A graph whose async node blocks its thread (a synchronous call) until released."""
    del model, tools

    async def node(state: MessagesState) -> dict:
        del state
        GRAPH_RELEASE.wait(2 * BOUND_S)
        GRAPH_WOKE.set()
        return {}

    return _one_node(node)


def stalling(model: Any, tools: Any) -> Any:
    """A graph that asks for one model turn, then awaits for ever."""
    del tools

    async def node(state: MessagesState) -> dict:
        await model.ainvoke(state["messages"])
        await asyncio.Event().wait()
        return {}

    return _one_node(node)


def _one_node(node: Any) -> Any:
    graph = StateGraph(MessagesState)
    graph.add_node("n", node)
    graph.add_edge(START, "n")
    graph.add_edge("n", END)
    return graph.compile()


def _react(backend: EmbeddedBackend, tokenizer: Tokenizer, graph: str) -> Trajectory:
    async def go() -> Trajectory:
        tools = LocalTools(ToolRegistry([]))
        cfg = AgentConfig(
            graph=f"{HERE}:{graph}",
            harness_timeout_s=TINY_S,
            max_turns=2,
            max_tokens_per_turn=4,
            max_model_len=256,
        )
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), cfg)
        sample = Sample("g", [{"role": "user", "content": "2+2?"}], "4", agent_name="react_agent")
        return await asyncio.wait_for(run_sample(sample, ctx), 3 * BOUND_S)  # (a bound on failing)

    return asyncio.run(go())


HERE = "tests.hostile.test_fifteenth_pass"
TINY_S = 0.05  # the graph's deadline under test (what it is, not how long anything takes)
STOPPED = f"agent.harness_timeout_s={TINY_S:g}s without a model turn or tool call"


def test_a_graph_awaiting_for_ever_is_stopped_at_its_deadline(
    backend: EmbeddedBackend, tokenizer: Tokenizer
) -> None:
    """Before the model's first turn: the graph's own failure (agent_error), naming the
    deadline (before: the episode, and the step, waited for ever)."""
    traj = _react(backend, tokenizer, "awaiting")
    assert traj.stop_reason == "agent_error" and STOPPED in str(traj.error)


def test_a_graph_blocking_its_thread_holds_not_the_rollout_loop(
    backend: EmbeddedBackend, tokenizer: Tokenizer
) -> None:
    """A graph that blocks its thread runs in a thread of its own: the rollout's loop goes on,
    stops it at its deadline and the episode ends (before: the loop itself was held)."""
    try:
        traj = _react(backend, tokenizer, "blocking")
    finally:
        GRAPH_RELEASE.set()
        assert GRAPH_WOKE.wait(BOUND_S)
    assert traj.stop_reason == "agent_error" and STOPPED in str(traj.error)


def test_a_graph_stalling_after_the_episode_ended_keeps_its_end(
    backend: EmbeddedBackend, tokenizer: Tokenizer
) -> None:
    """One model turn (it ends the episode: no calls), then the graph awaits for ever: the
    episode keeps how that turn ended it, the graph's stall added to its error."""
    traj = _react(backend, tokenizer, "stalling")
    assert traj.num_turns == 1 and traj.stop_reason in ("eos", "max_tokens_per_turn")
    assert f"then the graph failed:\nit held its episode past {STOPPED}" in str(traj.error)


def test_a_graph_failing_after_a_live_model_turn_is_a_wrong_answer(
    backend: EmbeddedBackend, tokenizer: Tokenizer
) -> None:
    """A graph that raises (or is stopped) after a model turn that left the episode going (its
    calls pending): it read the policy's text, so the episode ends caused_error (trained,
    outcome 0), as a harness's does (before: agent_error, untrained: a policy that made a
    user graph raise on its text escaped being wrong)."""

    async def go() -> tuple[StopReason, str]:
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(
            backend, tokenizer, tools, make_parser("hermes"), AgentConfig(max_model_len=256)
        )
        traj = Trajectory(uid="g/0", group_id="g", prompt_ids=[1], messages=[])
        traj.add_turn("call")
        return GraphEpisode(ctx, traj, {}).failed("ValueError: not JSON"), str(traj.error)

    stop, error = asyncio.run(go())
    assert stop == "caused_error" and "the graph failed after a model turn" in error
