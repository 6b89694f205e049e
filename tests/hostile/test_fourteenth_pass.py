"""The fourteenth adversarial pass.

- A harness (``openai_agent``) that never returned while its episode was live (it awaited for
  ever before its first request, looped without asking) held its episode and the step for
  ever: only an ended episode stopped its harness. Now a harness holding its live episode
  ``agent.harness_timeout_s`` without a request in progress is cancelled, the episode ended
  as a harness's failure: ``harness_error`` before any model turn, ``caused_error`` (trained,
  outcome 0) after one. And one that blocked its thread (a ``time.sleep`` in an async
  harness, a synchronous harness on a synchronous client) held the rollout's event loop, every
  episode and the backend with it, where nothing could stop it: each harness now runs in a
  thread and event loop of its own (`agent.harness_thread`), abandoned at the deadline.
- A request the endpoint refused after a model turn ended ``harness_error``, untrained, though
  the harness wrote it from the policy's text (its own tool's huge output: 413; an echo of the
  policy's JSON ``"\\ud800"``: 400): the escape the thirteenth pass closed for a harness that
  raises. It now ends ``caused_error`` (trained, outcome 0), as a raise does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any

import httpx
import pytest

from jax_agent_rl.agent import harness_thread
from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.harness_thread import nothing_left
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.openai_endpoint import AFTER_END_S, HarnessTask, Session, serve
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from tests.hostile.test_twelfth_pass import BOUND_S

HERE = "tests.hostile.test_fourteenth_pass"
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


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e7", "soon"])
def test_a_harness_timeout_outside_its_range_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match=r"agent\.harness_timeout_s=.*: expected (in|a number)"):
        load_config(
            None, ["model.path=m", "data.train=t.jsonl", f"agent.harness_timeout_s={value}"]
        )
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "agent.harness_timeout_s=30"])
    assert AgentConfig.of(cfg.agent).harness_timeout_s == 30.0  # (read by openai_agent)
    assert AgentConfig().harness_timeout_s == 300.0


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
