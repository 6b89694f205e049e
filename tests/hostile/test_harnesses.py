"""User harnesses (``openai_agent``) and ``react_agent`` graphs, user code that holds an episode,
against what keeps an episode, the step and the rollout's event loop going.

- A harness that never returned while its episode was live (it awaited for ever before its
  first request, looped without asking) held its episode and the step for ever: only an ended
  episode stopped its harness. Now a harness holding its live episode
  ``agent.harness_timeout_s`` without a request in progress is cancelled, the episode ended as
  a harness's failure: ``harness_error`` before any model turn, ``caused_error`` (trained,
  outcome 0) after one. And one that blocked its thread (a ``time.sleep`` in an async harness,
  a synchronous harness on a synchronous client) held the rollout's event loop, every episode
  and the backend with it, where nothing could stop it: each harness now runs in a thread and
  event loop of its own (`agent.harness_thread`), abandoned at the deadline.
- A request the endpoint refused after a model turn ended ``harness_error``, untrained, though
  the harness wrote it from the policy's text (its own tool's huge output: 413; an echo of the
  policy's JSON ``"\\ud800"``: 400): an escape from a wrong answer's penalty. It now ends
  ``caused_error`` (trained, outcome 0), as a raise does.
- A harness that retries every failed request (a careful user's loop: ask again until the
  model says it is done) once the episode had ended at a budget was answered 409 for ever, and
  its episode, and with it the step, never ended (4,440 requests in 60 s). Once the episode
  has ended, its next request (or ``run_tool``) has it cancelled (`usercode.threads.until_set`),
  the episode keeping its stop reason; one that awaits for ever without asking again is
  cancelled ``AFTER_END_S`` after the end.
- A graph ran on the rollout's loop with no deadline: one that awaited for ever held its
  episode and the step for ever, one that blocked its thread held every episode and the
  backend, and one that raised after a model turn (a node parsing the policy's text) ended
  ``agent_error``, untrained: a policy escaped being wrong by writing what the graph choked
  on. A graph now runs as a harness does, in a thread and event loop of its own, its model
  turns and tool calls on the rollout's loop, stopped once it holds its episode
  ``agent.harness_timeout_s`` without one in progress; failing after a live model turn ends
  ``caused_error`` (trained, outcome 0).
- A graph could run its episode's tools for ever: every tool call counted as the graph's
  activity (`Episode.on_rollout`), so its clock never ran, and nothing else bounded calls the
  model had not made. A graph that retries a call until its result holds no error, or that
  goes on calling tools once the model has answered, held its episode, and the step, for
  ever. The graph now runs each call of the model's last turn once, as the tool loop does; any
  other run raises (the graph's failure: ``caused_error`` after a model turn, an ended episode
  keeps its end).
- A graph's call whose arguments hold a key named ``self`` is answered as the loop answers
  any call the tool cannot take (an error observation), never a TypeError out of the graph's
  tool node that ended the episode with ``agent_error``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from jax_agent_rl.agent import harness_thread, langgraph_loop
from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.harness_thread import nothing_left
from jax_agent_rl.agent.langgraph_loop import GraphEpisode, episode_tools
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.openai_endpoint import AFTER_END_S, HarnessTask, Session, serve
from jax_agent_rl.agent.trajectory import StopReason, Trajectory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    Tokenizer,
)
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry

BOUND_S = 30.0  # how long a wait on a thread's event may take (the test fails past it)


HERE = "tests.hostile.test_harnesses"


_ASKED: list[int] = []  # the statuses the retrying harness got


_STOPPED: list[bool] = []  # it was cancelled


async def retrying_harness(task: HarnessTask) -> None:
    """Asks until the model says FINAL, asking again after any error (for ever)."""
    messages = list(task.messages)
    headers = {"Authorization": f"Bearer {task.api_key}"}
    try:
        # (no client timeout: on a loaded machine a reply takes what it takes, and httpx's
        # 5 s default ended the harness with a ReadTimeout; the test bounds the episode)
        async with httpx.AsyncClient(timeout=None) as client:
            while True:
                body = {"messages": messages, "model": "m"}
                url = f"{task.base_url}/chat/completions"
                r = await client.post(url, json=body, headers=headers)
                _ASKED.append(r.status_code)
                if r.status_code != 200:
                    continue  # (again, whatever went wrong)
                said = r.json()["choices"][0]["message"]["content"]
                if "FINAL" in said:
                    return
                messages.append({"role": "assistant", "content": said})
                messages.append({"role": "user", "content": "Go on; say FINAL when done."})
    except asyncio.CancelledError:
        _STOPPED.append(True)
        raise


def test_a_harness_that_asks_on_after_its_episode_ended_is_stopped(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    config = AgentConfig(
        harness=f"{HERE}:retrying_harness", max_turns=1, max_tokens_per_turn=1, max_model_len=256
    )  # (one turn of one token: no call, so the episode ends at a budget)

    async def go() -> Trajectory:
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), config)
        sample = Sample("r", [{"role": "user", "content": "2+2?"}], "4", agent_name="openai_agent")
        return await asyncio.wait_for(run_sample(sample, ctx), BOUND_S)  # (a bound on failing)

    traj = asyncio.run(go())  # (before: it never returned)
    assert traj.stop_reason in ("max_tokens_per_turn", "max_turns")
    assert _ASKED[0] == 200 and set(_ASKED[1:]) <= {409}  # (stopped as its request was refused)
    assert _STOPPED == [True]


_WAITING: list[str] = []  # what the waiting harness did


async def waiting_harness(task: HarnessTask) -> None:
    """Asks once, then awaits a reply it will never get (a queue no one fills)."""
    headers = {"Authorization": f"Bearer {task.api_key}"}
    body = {"messages": task.messages, "model": "m"}
    # (no client timeout: on a loaded machine a reply takes what it takes; the test bounds
    # the episode)
    async with httpx.AsyncClient(timeout=None) as client:
        r = await client.post(f"{task.base_url}/chat/completions", json=body, headers=headers)
    _WAITING.append(r.json()["choices"][0]["finish_reason"])
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        _WAITING.append("cancelled")
        raise


def test_a_harness_awaiting_for_ever_after_its_episode_ended_is_cancelled(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    config = AgentConfig(
        harness=f"{HERE}:waiting_harness", max_turns=1, max_tokens_per_turn=1, max_model_len=256
    )  # (one turn of one token: no call, so the episode ends at a budget)

    async def go() -> Trajectory:
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), config)
        sample = Sample("w", [{"role": "user", "content": "2+2?"}], "4", agent_name="openai_agent")
        return await asyncio.wait_for(run_sample(sample, ctx), BOUND_S)  # (a bound on failing)

    traj = asyncio.run(go())  # (before: it never returned)
    assert traj.stop_reason in ("max_tokens_per_turn", "max_turns") and traj.trainable
    assert _WAITING == ["length", "cancelled"]


TINY_S = 0.05  # the deadline under test (what it is, not how long anything takes, is tested)


SEEN: list[str] = []  # what the harnesses did, in order (appended from their threads)


RELEASE = threading.Event()  # the blocking harnesses' threads wait on it (released at the end)


async def silent(task: HarnessTask) -> None:
    """Awaits for ever before its first request (a queue no one fills)."""
    del task
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        SEEN.append("cancelled")
        raise


async def sleeping(task: HarnessTask) -> None:
    """Blocks its thread (as a ``time.sleep`` does) before its first request."""
    del task
    RELEASE.wait(2 * BOUND_S)
    SEEN.append("woke")


def synchronous(task: HarnessTask) -> None:
    """A synchronous harness on a synchronous client (which on the rollout's event loop waited
    for an endpoint that loop could no longer serve)."""
    SEEN.append(_ask_sync(task))


async def _ask(task: HarnessTask) -> str:
    async with httpx.AsyncClient(timeout=BOUND_S) as client:  # (a first turn compiles)
        r = await client.post(**_request(task))
    return str(r.json()["choices"][0]["finish_reason"])


def _ask_sync(task: HarnessTask) -> str:
    with httpx.Client(timeout=BOUND_S) as client:
        r = client.post(**_request(task))
    return str(r.json()["choices"][0]["finish_reason"])


def _request(task: HarnessTask) -> dict[str, Any]:
    return {
        "url": f"{task.base_url}/chat/completions",
        "json": {"messages": task.messages, "model": "m"},
        "headers": {"Authorization": f"Bearer {task.api_key}"},
    }


def _live(tokenizer: Tokenizer) -> tuple[str, ...]:
    """Stop strings that end a model turn at its first token with text (every token's first
    character): the turn ends as a text turn would, so the episode goes on after it."""
    return tuple(sorted({t[0] for t in map(tokenizer.decode, ([i] for i in range(300))) if t}))


def _episode(
    backend: EmbeddedBackend,
    tokenizer: Tokenizer,
    harness: str,
    prompt: str = "2+2?",
    **config: Any,
) -> Trajectory:
    config = {"max_turns": 4, "max_tokens_per_turn": 4, "max_model_len": 256, **config}

    async def go() -> Trajectory:
        tools = LocalTools(ToolRegistry([]))
        cfg = AgentConfig(harness=f"{HERE}:{harness}", **config)
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), cfg)
        sample = Sample("h", [{"role": "user", "content": prompt}], "4", agent_name="openai_agent")
        return await asyncio.wait_for(run_sample(sample, ctx), BOUND_S)  # (a bound on failing)

    SEEN.clear()
    return asyncio.run(go())


async def relaying(task: HarnessTask) -> None:
    """After the model's first turn, passes on what its own tool made of the policy's text, as
    a user message: a huge file's text (its body is past the endpoint's limit), or an echo of
    the policy's JSON ``"\\ud800"`` (a lone surrogate)."""
    request = _request(task)
    async with httpx.AsyncClient(timeout=BOUND_S) as client:
        r = await client.post(**request)
        turn = r.json()["choices"][0]["message"]
        said = "x" * (5 * 2**20) if task.messages[-1]["content"] == "huge" else "echo: \ud800"
        body = request.pop("json")
        body["messages"] += [turn, {"role": "user", "content": said}]
        request["content"] = json.dumps(body)  # (ASCII: "\\ud800" as JSON writes it)
        request["headers"]["Content-Type"] = "application/json"
        with contextlib.suppress(httpx.TransportError):  # (413: closed while it still sends)
            SEEN.append(str((await client.post(**request)).status_code))


def _stopped_at_the_deadline(traj: Trajectory) -> bool:
    return f"agent.harness_timeout_s={TINY_S:g}s without a request" in str(traj.error)


def test_a_harness_awaiting_for_ever_before_its_first_request_is_stopped(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    traj = _episode(backend, tokenizer, "silent", harness_timeout_s=TINY_S)  # (before: hung)
    assert (traj.stop_reason, traj.trainable) == ("harness_error", False)
    assert _stopped_at_the_deadline(traj) and SEEN == ["cancelled"]


def test_a_harness_holding_its_episode_after_a_turn_is_a_wrong_answer(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    """Its first request answered (a text turn: the episode goes on), the harness asks nothing
    more (it awaits, or loops without asking): past the deadline its episode ends
    caused_error, trained as a wrong answer (before: nothing watched a live episode)."""
    config = AgentConfig(max_tokens_per_turn=4, max_model_len=256, stop=_live(tokenizer))

    async def go() -> tuple[Session, str]:
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), config)
        session = Session(ctx, Trajectory(uid="h", group_id="h", prompt_ids=[]), {})
        done = asyncio.Event()
        async with serve({"k": session}) as base_url:
            task = HarnessTask(base_url, "k", [{"role": "user", "content": "2+2?"}], [], _none)
            finish = await _ask(task)
            await nothing_left(session, done, TINY_S, AFTER_END_S)  # (no request follows)
        return session, finish

    session, finish = asyncio.run(go())
    assert (finish, session.stop, session.traj.num_turns) == ("stop", "caused_error", 1)
    assert _stopped_at_the_deadline(session.traj) and session.traj.trainable


async def _none(tool_call: dict[str, Any]) -> str:
    raise AssertionError(f"no tool runs here: {tool_call}")


def test_a_harness_blocking_its_thread_holds_neither_the_loop_nor_the_step(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    """The blocked harness is abandoned at the deadline, counted as stuck until it wakes;
    a second episode runs meanwhile (before: the event loop itself was blocked)."""
    try:
        traj = _episode(backend, tokenizer, "sleeping", harness_timeout_s=TINY_S)
        assert (traj.stop_reason, traj.trainable) == ("harness_error", False)
        assert _stopped_at_the_deadline(traj) and "woke" not in SEEN
        assert harness_thread.THREADS.stuck == 1
        stop = _live(tokenizer)
        other = _episode(backend, tokenizer, "synchronous", max_turns=1, stop=stop)
        assert (other.stop_reason, SEEN) == ("eos", ["stop"]), other.error  # (before: deadlocked)
    finally:
        RELEASE.set()
    for thread in threading.enumerate():
        if thread.name == "jarl-harness":
            thread.join(BOUND_S)
    assert harness_thread.THREADS.stuck == 0


def test_past_the_stuck_threads_bound_no_harness_starts(
    tokenizer: Tokenizer, backend: EmbeddedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness_thread, "THREADS", harness_thread.HarnessThreads(0))
    traj = _episode(backend, tokenizer, "silent", harness_timeout_s=TINY_S)
    assert (traj.stop_reason, traj.trainable, SEEN) == ("harness_error", False, [])
    assert "0 harness threads are still running past their episodes' end" in str(traj.error)


@pytest.mark.parametrize("prompt", ["huge", "surrogate"])
def test_a_request_refused_after_a_turn_is_a_wrong_answer(
    tokenizer: Tokenizer, backend: EmbeddedBackend, prompt: str
) -> None:
    """The refused request carries what the policy's text led the harness to write: as
    harness_error (untrained, before) the episode escaped the negative advantage of a wrong
    answer; before any model turn a refusal stays harness_error."""
    stop = _live(tokenizer)
    traj = _episode(backend, tokenizer, "relaying", prompt, stop=stop)
    assert (traj.stop_reason, traj.trainable, traj.num_turns) == ("caused_error", True, 1)
    said = "request body is over" if prompt == "huge" else "holds a lone surrogate"
    assert said in str(traj.error) and SEEN in ([], ["413"], ["400"])


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


async def _held_once_the_turn_ended(
    idle: asyncio.Event, asked: asyncio.Event, timeout_s: float
) -> None:
    """The deadline's watch (`harness_thread.held_too_long`) passed at once after the graph's
    first model turn ends: a deadline of ``TINY_S`` could pass before a loaded machine's
    graph thread even reached its first turn (the episode then had none)."""
    del timeout_s
    await asked.wait()
    await idle.wait()


def test_a_graph_stalling_after_the_episode_ended_keeps_its_end(
    backend: EmbeddedBackend, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One model turn (it ends the episode: no calls), then the graph awaits for ever: the
    episode keeps how that turn ended it, the graph's stall added to its error."""
    monkeypatch.setattr(langgraph_loop, "held_too_long", _held_once_the_turn_ended)
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


RUNS: list[int] = []  # how many tool runs the looping graph got through (one test at a time)


def looping(model: Any, tools: Any) -> Any:
    """A graph that takes one model turn, then retries a call "until it holds no error", which
    the tools never give it: it calls the tool for ever."""
    invalid = tools[-1]  # (invalid_tool_call: its answer is always an error)
    call = {"name": "x", "arguments": {}, "error": "bad", "refused": False}

    async def node(state: MessagesState) -> dict[str, Any]:
        await model.ainvoke(state["messages"])
        RUNS.append(0)
        while (await invalid.ainvoke(call)).startswith("error"):
            RUNS[-1] += 1
        return {}

    graph = StateGraph(MessagesState)
    graph.add_node("n", node)
    graph.add_edge(START, "n")
    graph.add_edge("n", END)
    return graph.compile()


def test_a_graph_that_runs_tools_for_ever_ends_its_episode(
    backend: EmbeddedBackend, tokenizer: Tokenizer
) -> None:
    """The looping graph's episode ends, with its model turn's end kept and the refused run
    named; no tool ran past the model's calls (before: the episode never ended, the bound
    below failed the test)."""

    async def go() -> Trajectory:
        tools = LocalTools(ToolRegistry([]))
        cfg = AgentConfig(
            graph=f"{HERE}:looping", max_turns=2, max_tokens_per_turn=4, max_model_len=256
        )
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), cfg)
        sample = Sample("g", [{"role": "user", "content": "2+2?"}], "4", agent_name="react_agent")
        return await asyncio.wait_for(run_sample(sample, ctx), 3 * BOUND_S)  # (a hang guard)

    RUNS.clear()
    traj = asyncio.run(go())
    assert traj.num_turns == 1 and traj.stop_reason in ("eos", "max_tokens_per_turn")
    assert "ran a tool call the model's last turn did not make" in str(traj.error)
    assert RUNS == [0] and traj.malformed_calls == 0


@pytest.mark.parametrize("key", ["self", "arguments", "run_manager", "config"])
def test_a_react_call_with_an_argument_named_self_is_an_error_observation(
    context: AgentContext, key: str
) -> None:
    """The graph's tool node runs the model's call of a listed tool with the arguments it
    wrote; ``self`` among them met ``EpisodeTool._arun``'s own ``self`` (a TypeError out of
    the tool node: the episode ended ``agent_error``). Now every key reaches the executor,
    which refuses the unknown argument as the tool loop does."""
    episode = GraphEpisode(context, Trajectory(uid="t", group_id="g", prompt_ids=[]), {})
    episode.allow_runs(1)  # (as the model's turn with the one call does)
    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode(episode_tools(episode)))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    call = {"name": "calculator", "args": {"expression": "1 + 1", key: 1}, "id": "call_1_0"}
    out = asyncio.run(graph.compile().ainvoke({"messages": [AIMessage("", tool_calls=[call])]}))
    answer = out["messages"][-1]
    assert isinstance(answer, ToolMessage)
    want = f"error: bad arguments for calculator: unknown argument(s) ['{key}']; expected "
    assert answer.content == want + "['expression']"


def test_a_react_turns_tool_calls_keep_its_episode_busy_until_the_last_ends(
    context: AgentContext,
) -> None:
    """A turn's tool calls run together (LangGraph's ToolNode): the episode is idle, its
    agent.harness_timeout_s clock running, only once the last has ended. Before, the first to
    end marked it idle while the others ran, and a graph waiting on a slow tool could be
    stopped as holding its episode "without a model turn or tool call in progress"."""
    episode = GraphEpisode(context, Trajectory(uid="t", group_id="g", prompt_ids=[]), {})

    async def go() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        a = asyncio.ensure_future(episode.on_rollout(first.wait()))
        b = asyncio.ensure_future(episode.on_rollout(second.wait()))
        while episode.in_progress < 2:  # (both started: the loop's turns, not time)
            await asyncio.sleep(0)
        first.set()
        await a
        assert not episode.idle.is_set()  # the second still runs
        second.set()
        await b
        assert episode.idle.is_set()

    asyncio.run(go())
