"""The OpenAI-compatible endpoint (agent/openai_endpoint.py) against a harness that attacks its
siblings or the trainer. Under GRPO a policy that ends a sibling's episode gains reward, so
each attack here is a reward hack: a guessed session key, a request left open to hold the
episode, connections and bodies that exhaust the trainer, requests that stall the event
loop, and request fields that should not end an episode.

Timeouts under test are configured small; every wait is on a state (a response, a closed
connection, a finished episode, a session in a request), never on elapsed time.

A first request whose tools held a lone surrogate, or nested as deep as the endpoint's JSON
reader reads, failed past its checks (in the tokenizer, in encoding the tools a call deeper):
the endpoint's own failure, answered 500 and ended as ``agent_error`` with a traceback, rather
than the harness's bad request (400, ``harness_error``); and a body holding ``NaN`` or
``1e999`` (Python's JSON reader takes them, no strict one does) was taken, a NaN in the tools
then making every later request's tools differ from the first's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
from typing import Any

import openai
import pytest

from jax_agent_rl.agent import openai_endpoint
from jax_agent_rl.agent.context import AgentConfig
from jax_agent_rl.agent.endpoint_http import MAX_HEADER_BYTES, Limits, Request, serve_http
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.openai_endpoint import HarnessTask, Session, serve
from jax_agent_rl.agent.openai_requests import (
    MAX_TOOLS_BYTES,
    MAX_TOOLS_DEPTH,
    HarnessError,
    check_request,
)
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.tokenization.tool_calls import ParsedCall
from jax_agent_rl.tokenization.turns import TurnBuilder
from tests.agent.test_langgraph_loop import _assert_same
from tests.agent.test_loop import CONFIG
from tests.agent.test_openai_endpoint import (
    PROMPT,
    QUESTION,
    _context,
    _episode,
    _fresh,
    openai_harness,
)

CHATML = pytest.mark.parametrize("setup", ["chatml"], indirect=True)
HERE = "tests.hostile.test_openai_endpoint"
PLAY: dict[str, Any] = {}  # what the harnesses of one test share (each runs in its own thread)
BOUND_S = 30.0  # how long a wait on another thread's event may take (the test fails past it)


async def _waited(event: threading.Event) -> None:
    """``event`` waited for from a harness's event loop (it is set from another thread)."""
    assert await asyncio.to_thread(event.wait, BOUND_S), "waited past BOUND_S"


def _harness(config: AgentConfig, name: str) -> AgentConfig:
    return dataclasses.replace(config, harness=f"{HERE}:{name}")


async def _post(port: int, key: str, body: bytes, length: int | None = None) -> bytes:
    """A raw request (``length``: its Content-Length, when the body sent is cut short); the
    server's whole answer, once it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length or len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (an end of file, or a reset), once it has."""
    try:
        return await reader.read() == b""
    except ConnectionResetError:
        return True


def _port(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def converse(task: HarnessTask, paused: Any = None, **fields: Any) -> None:
    """`openai_harness`'s episode, its requests carrying ``fields``; ``paused`` is awaited
    after the first reply."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages: list[Any] = list(task.messages)
    while True:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=task.tools, **fields
        )
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if paused is not None:
            await paused(messages[-1])
            paused = None
        if choice.finish_reason != "tool_calls":
            return
        for call in choice.message.tool_calls or []:
            text = await task.run_tool(call.model_dump())
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})


async def group_harness(task: HarnessTask) -> None:
    """The victim (the sample asking QUESTION) plays an ordinary episode, pausing before its
    first request and after its first reply; meanwhile the attacker (the other sample) finds
    its port (as a scan of loopback would) and sends requests with guessed keys."""
    if task.messages[0]["content"] == QUESTION:
        PLAY["victim"] = task
        PLAY["found"].set()
        await _waited(PLAY["first_attack"])

        async def paused(turn: dict[str, Any]) -> None:
            PLAY["turn"] = turn
            PLAY["replied"].set()
            await _waited(PLAY["second_attack"])

        try:
            await converse(task, paused)
        finally:
            PLAY["replied"].set()  # (also when the victim's first request failed)
        return
    await _waited(PLAY["found"])
    victim: HarnessTask = PLAY["victim"]
    port = _port(victim.base_url)
    # the victim's trajectory uid (`<row>/<tag>/<i>` is known), and this harness's own key
    # with its last character changed
    guesses = [PLAY["victim_uid"], *(task.api_key[:-1] + c for c in "0123456789")]
    other = json.dumps({"messages": [{"role": "user", "content": "Say nothing."}]}).encode()
    PLAY["answers"] = [await _post(port, g, other) for g in guesses]
    PLAY["first_attack"].set()
    await _waited(PLAY["replied"])
    wrong = {"role": "assistant", "content": "x", "tool_calls": [PLAY["wrong_call"]]}
    tool = {"role": "tool", "tool_call_id": "call_1_0", "content": "2"}
    rewrite = json.dumps({"messages": [*victim.messages, wrong, tool]}).encode()
    PLAY["answers"] += [await _post(port, g, rewrite) for g in guesses]
    PLAY["second_attack"].set()


@CHATML
def test_a_sibling_cannot_guess_a_session_key(setup: dict[str, Any]) -> None:
    """The attacker sends the victim's first request with another prompt, then a wrong
    assistant turn (a 400 would quote the victim's real call): every guess is refused 401,
    no answer holds the victim's call, and the victim's episode is the tool loop's."""
    victim_uid = f"q{sorted(setup['expected']).index(QUESTION)}"
    wrong_call = {
        "id": "call_1_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1 + 1"}'},
    }

    async def go() -> list[Trajectory]:
        PLAY.clear()
        PLAY.update({e: threading.Event() for e in ("found", "first_attack", "replied")})
        PLAY.update(second_attack=threading.Event(), victim_uid=victim_uid, wrong_call=wrong_call)
        ctx = await _context(setup, _harness(CONFIG, "group_harness"), None)
        samples = [
            Sample(uid=victim_uid, messages=PROMPT, agent_name="openai_agent"),
            Sample(
                uid=f"{victim_uid}/1",
                messages=[{"role": "user", "content": "attack"}],
                agent_name="openai_agent",
            ),
        ]
        trajs = await asyncio.gather(*(run_sample(s, ctx) for s in samples))
        await ctx.backend.close()
        return trajs

    victim, _ = asyncio.run(go())
    answers = PLAY["answers"]
    assert [_status(a) for a in answers] == [401] * len(answers)
    real_arguments = PLAY["turn"]["tool_calls"][0]["function"]["arguments"]
    assert not any(json.loads(real_arguments)["expression"].encode() in a for a in answers)
    _assert_same(victim, _episode(setup, QUESTION, "tool_agent", CONFIG))
    assert victim.stop_reason == "eos"


async def lingering_harness(task: HarnessTask) -> None:
    """An ordinary episode, then a request whose body never completes, left open (on a plain
    socket, which outlives the harness's event loop)."""
    await openai_harness(task)
    sock = socket.create_connection(("127.0.0.1", _port(task.base_url)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        f"{task.api_key}\r\nContent-Length: 1000\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"messages"')
    PLAY["open"] = sock


@CHATML
def test_a_request_left_open_does_not_hold_the_episode(
    setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness returns with a request in progress: the episode ends once the shutdown's
    grace has passed (the request's connection is closed), and it is the tool loop's."""
    limits = Limits(shutdown_grace_s=0.01, body_timeout_s=3600.0, header_timeout_s=3600.0)
    monkeypatch.setattr(openai_endpoint, "LIMITS", limits)
    config = _harness(CONFIG, "lingering_harness")

    async def go() -> tuple[Trajectory, bool]:
        PLAY.clear()
        ctx = await _context(setup, config, None)
        sample = Sample(
            uid=f"q{sorted(setup['expected']).index(QUESTION)}",
            messages=PROMPT,
            agent_name="openai_agent",
        )
        traj = await run_sample(sample, ctx)  # (before the fix: never returns)
        await ctx.backend.close()
        sock = PLAY["open"]
        sock.settimeout(BOUND_S)  # (a bound on failing)
        try:
            closed = await asyncio.to_thread(sock.recv, 1) == b""
        except ConnectionResetError:
            closed = True
        sock.close()
        return traj, closed

    traj, closed = asyncio.run(go())
    assert closed
    assert traj.stop_reason == "eos"
    _assert_same(traj, _episode(setup, QUESTION, "tool_agent", config))


def test_shutdown_waits_for_requests_within_the_grace_then_closes_the_rest() -> None:
    """Leaving `serve_http`: a request in progress that ends within the grace is answered;
    past the grace, one still in progress is cancelled and its connection closed."""

    async def go() -> None:
        entered, release, cancelled = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def handle(request: Request) -> tuple[int, dict[str, Any]]:
            entered.set()
            if request.target == "/finishing":
                await release.wait()
                return 200, {"ok": True}
            try:
                await request.body()  # never complete
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("the body cannot have arrived")

        async def request(port: int, target: str) -> tuple[asyncio.StreamReader, Any]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n1".encode()
            )
            await writer.drain()
            await entered.wait()
            entered.clear()
            return reader, writer

        patient = serve_http(handle, Limits(shutdown_grace_s=3600.0))
        reader, writer = await request(await patient.__aenter__(), "/finishing")
        shutdown = asyncio.create_task(patient.__aexit__(None, None, None))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not shutdown.done()  # it waits for the request in progress
        release.set()
        answer = await reader.read()
        await shutdown
        assert _status(answer) == 200 and answer.endswith(b'{"ok": true}')
        writer.close()

        hasty = serve_http(handle, Limits(shutdown_grace_s=0.01, body_timeout_s=3600.0))
        reader, writer = await request(await hasty.__aenter__(), "/stuck")
        await hasty.__aexit__(None, None, None)  # (would wait for the body forever)
        assert cancelled.is_set() and await _closed(reader)
        writer.close()

    asyncio.run(go())


def test_connections_past_the_limit_close_the_oldest_idle_ones() -> None:
    """Twelve connections that send nothing, under a limit of four: the first eight are
    closed as the later ones come; the last four are served, as is a client arriving then."""

    async def go() -> None:
        limits = Limits(max_connections=4, header_timeout_s=3600.0)
        async with serve({}, limits) as base_url:
            port = _port(base_url)
            opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(12)]
            for reader, _ in opened[:8]:
                assert await _closed(reader)  # by the server
            served = [_status(await _post(port, "nobody", b"{}"))]  # evicts one of the four
            for reader, writer in opened[9:]:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                writer.write(b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
                served.append(_status(await reader.read()))
            assert served == [401] * 4
            for _, writer in opened:
                writer.close()

    asyncio.run(go())


def test_headers_must_arrive_in_time() -> None:
    """A connection that sends a request line and never ends its headers is closed."""

    async def go() -> None:
        async with serve({}, Limits(header_timeout_s=0.01)) as base_url:
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(base_url))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            assert await _closed(reader)  # (before the fix: never closed)
            writer.close()

    asyncio.run(go())


@pytest.mark.parametrize("size", [16 * 2**10 + 1, 17_000, 60_000])
def test_request_heads_past_16_kib_are_not_served(size: int) -> None:
    """A request head (line and headers) past ``MAX_HEADER_BYTES`` closes the connection
    unanswered: one that arrived whole in a read (17 KB, 60 KB) was parsed and answered. A
    head of exactly the bound is answered."""

    async def head(base_url: str, n: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(base_url))
        start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        end = b"Content-Length: 2\r\nConnection: close\r\n\r\n"
        pad = n - len(start) - len(end) - len(b"X-Pad: \r\n")
        writer.write(start + b"X-Pad: " + b"a" * pad + b"\r\n" + end + b"{}")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        return answer

    async def go() -> None:
        async with serve({}, Limits()) as base_url:
            assert await head(base_url, size) == b""
            assert _status(await head(base_url, MAX_HEADER_BYTES)) == 401

    asyncio.run(go())


@CHATML
def test_bodies_are_bounded_in_size_time_and_number(setup: dict[str, Any]) -> None:
    """Bodies are read one at a time per session and only for its key: a wrong key is answered
    401 from the headers, a second request while one is in progress 400 from its headers
    (its body is never held), a body over the limit 413 from its Content-Length, and one too
    slow 408; each of those ends its own session only."""

    async def go() -> dict[str, Session]:
        ctx = await _context(setup, CONFIG, None)
        names = ("slow", "busy", "large")
        sessions = {n: _fresh(ctx, f"s-{n}") for n in names}
        big = 2 * 2**20
        async with serve(sessions, Limits(body_timeout_s=3600.0)) as base_url:
            port = _port(base_url)
            assert _status(await _post(port, "nobody", b"", length=big)) == 401
            assert _status(await _post(port, "large", b"", length=5 * 2**20)) == 413
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Session-Id: busy\r\n"
                f"Content-Length: {big}\r\n\r\n{{".encode()
            )
            await writer.drain()
            while not sessions["busy"].busy:  # the first request is in progress
                await asyncio.sleep(0)
            second = await _post(port, "busy", b"", length=big)
            assert _status(second) == 400 and b"a second request while one" in second
            writer.close()
        async with serve(sessions, Limits(body_timeout_s=0.01)) as base_url:
            answer = await _post(_port(base_url), "slow", b"{", length=100)
            assert _status(answer) == 408
        await ctx.backend.close()
        return sessions

    sessions = asyncio.run(go())
    for name, session in sessions.items():
        assert session.stop == "harness_error" and session.traj.prompt_ids == [], name


@CHATML
def test_more_messages_than_the_context_holds_are_refused_before_rendering(
    setup: dict[str, Any],
) -> None:
    """A 4 MB request of empty messages passes the size limits; more messages than
    max_model_len tokens (one each at least) cannot fit: 400 before they are compared or
    rendered (before: the template rendered 140k messages on the event loop, seconds each)."""

    async def go() -> tuple[Session, bytes]:
        ctx = await _context(setup, CONFIG, None)
        session = _fresh(ctx, "many")
        messages = [{"role": "user", "content": ""}] * (CONFIG.max_model_len + 1)
        body = json.dumps({"messages": messages}).encode()
        async with serve({"many": session}) as base_url:
            answer = await _post(_port(base_url), "many", body)
        await ctx.backend.close()
        return session, answer

    session, answer = asyncio.run(go())
    assert _status(answer) == 400
    assert f"{CONFIG.max_model_len + 1} messages cannot fit".encode() in answer
    assert session.finish() == "harness_error" and session.traj.prompt_ids == []


class Held:
    """The real backend, whose first request waits until ``release`` is set."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.capabilities = backend, backend.capabilities
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def generate(self, request: Any) -> Any:
        if not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
        return await self.backend.generate(request)

    async def close(self) -> None:
        await self.backend.close()


@CHATML
def test_a_turn_ending_at_a_budget_keeps_the_harness_error_a_second_request_made(
    setup: dict[str, Any],
) -> None:
    """A second request while the first is sampled ends the episode as harness_error; the
    first, let go then, ends its turn at max_tokens_per_turn, and the episode stays a harness
    error, which is not trained on (before: the budget's stop replaced it, a trainable end)."""
    config = dataclasses.replace(CONFIG, max_tokens_per_turn=5)

    async def go() -> tuple[Session, bytes, bytes]:
        ctx = await _context(setup, config, None)
        held = Held(ctx.backend)
        ctx = dataclasses.replace(ctx, backend=held)  # type: ignore[arg-type]
        session = _fresh(ctx, "twice")
        body = json.dumps({"messages": PROMPT, "tools": ctx.builder.tools}).encode()
        async with serve({"twice": session}) as base_url:
            first = asyncio.create_task(_post(_port(base_url), "twice", body))
            await held.entered.wait()
            second = await _post(_port(base_url), "twice", body)
            held.release.set()
            answered = await first
        await ctx.backend.close()
        return session, second, answered

    session, second, answered = asyncio.run(go())
    assert _status(second) == 400 and b"a second request while one" in second
    assert _status(answered) == 200 and b'"finish_reason":"length"' in answered.replace(b" ", b"")
    assert session.finish() == "harness_error"


@CHATML
def test_tools_too_large_are_refused_before_rendering(setup: dict[str, Any]) -> None:
    """Tools past MAX_TOOLS_BYTES (rendering them into the prompt would stall the event loop)
    are answered 400 without being rendered; the session ends."""

    async def go() -> tuple[Session, bytes]:
        ctx = await _context(setup, CONFIG, None)
        session = _fresh(ctx, "tools")
        schema = dict(ctx.builder.tools[0])  # type: ignore[index]
        tools = [dict(schema, description="x" * 4096) for _ in range(MAX_TOOLS_BYTES // 4096)]
        body = json.dumps({"messages": PROMPT, "tools": tools}).encode()
        async with serve({"tools": session}) as base_url:
            answer = await _post(_port(base_url), "tools", body)
        await ctx.backend.close()
        return session, answer

    session, answer = asyncio.run(go())
    assert _status(answer) == 400 and b"tools are over" in answer
    assert session.stop == "harness_error" and session.traj.prompt_ids == []


async def chatty_harness(task: HarnessTask) -> None:
    """`openai_harness` with request fields clients add that do not change sampling, and
    one from a later version of the API."""
    extra = {"user": "me", "metadata": {"run": "1"}, "store": False, "service_tier": "auto"}
    await converse(task, None, **extra, extra_body={"a_field_from_a_later_api": True})


@CHATML
def test_fields_that_do_not_change_sampling_are_ignored(setup: dict[str, Any]) -> None:
    config = _harness(CONFIG, "chatty_harness")
    traj = _episode(setup, QUESTION, "openai_agent", config)
    _assert_same(traj, _episode(setup, QUESTION, "tool_agent", config))


def _reply(answer: bytes) -> dict[str, Any]:
    """The message of a 200 answer."""
    assert _status(answer) == 200, answer
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]


@CHATML
def test_a_tool_call_id_that_is_not_a_string_ends_its_episode_as_a_harness_failure(
    setup: dict[str, Any],
) -> None:
    """A tool message whose tool_call_id is a list: 400, the episode ends as a harness's
    failure, caused_error after the model's turn (before: a 500 that left the session
    half-changed, each later request failing on an assertion, and the episode ending as
    agent_error)."""

    async def go() -> tuple[Session, bytes, bytes]:
        ctx = await _context(setup, CONFIG, None)
        session = _fresh(ctx, "ids")
        async with serve({"ids": session}) as base_url:
            port = _port(base_url)
            tools = ctx.builder.tools
            turn = _reply(
                await _post(port, "ids", json.dumps({"messages": PROMPT, "tools": tools}).encode())
            )
            (call,) = turn["tool_calls"]
            tool = {"role": "tool", "tool_call_id": [call["id"]], "content": "42"}
            messages = [*PROMPT, turn, tool]
            body = json.dumps({"messages": messages, "tools": tools}).encode()
            bad = await _post(port, "ids", body)
            user = {"role": "user", "content": "and?"}
            body = json.dumps({"messages": [*messages, user], "tools": tools}).encode()
            after = await _post(port, "ids", body)
        await ctx.backend.close()
        return session, bad, after

    session, bad, after = asyncio.run(go())
    assert _status(bad) == 400 and b"tool_call_id must be a string" in bad
    assert _status(after) == 409
    assert session.finish() == "caused_error"


@CHATML
def test_a_message_holding_a_lone_surrogate_ends_its_episode_as_a_harness_error(
    setup: dict[str, Any],
) -> None:
    """JSON's ``"\\ud800"`` is a string no tokenizer takes: 400, harness_error (before: the
    tokenizer's TypeError, a 500)."""

    async def go() -> tuple[Session, bytes]:
        ctx = await _context(setup, CONFIG, None)
        session = _fresh(ctx, "surrogate")
        body = b'{"messages": [{"role": "user", "content": "What is \\ud800?"}]}'
        async with serve({"surrogate": session}) as base_url:
            answer = await _post(_port(base_url), "surrogate", body)
        await ctx.backend.close()
        return session, answer

    session, answer = asyncio.run(go())
    assert _status(answer) == 400 and b"lone surrogate" in answer
    assert session.stop == "harness_error" and session.traj.prompt_ids == []


class Gated:
    """The real backend, whose ``n``-th request waits (``entered`` set) until cancelled."""

    def __init__(self, backend: Any, n: int) -> None:
        self.backend, self.n = backend, n
        self.capabilities = backend.capabilities
        self.entered = threading.Event()  # (a harness waits for it from its own thread)

    async def generate(self, request: Any) -> Any:
        self.n -= 1
        if self.n == 0:
            self.entered.set()
            await asyncio.Event().wait()
        return await self.backend.generate(request)

    async def close(self) -> None:
        await self.backend.close()


async def returning_harness(task: HarnessTask) -> None:
    """Answers the model's first call, sends the next request, and returns while the model's
    second turn is being sampled."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model="policy", messages=task.messages, tools=task.tools
    )
    message = reply.choices[0].message.model_dump(exclude_none=True)
    (call,) = reply.choices[0].message.tool_calls or []
    tool = {
        "role": "tool",
        "tool_call_id": call.id,
        "content": await task.run_tool(call.model_dump()),
    }
    second = asyncio.create_task(  # (cancelled as the harness's event loop closes)
        client.chat.completions.create(
            model="policy", messages=[*task.messages, message, tool], tools=task.tools
        )
    )
    await _waited(PLAY["gated"].entered)
    assert not second.done()


@CHATML
def test_a_harness_that_returns_during_a_model_turn_ends_its_episode_as_a_harness_error(
    setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request is closed past the shutdown's grace, mid-turn: the episode ends with
    harness_error, its tool call kept (before: an assertion failed, agent_error)."""
    monkeypatch.setattr(openai_endpoint, "LIMITS", Limits(shutdown_grace_s=0.01))
    config = _harness(CONFIG, "returning_harness")

    async def go() -> Trajectory:
        PLAY.clear()
        ctx = await _context(setup, config, None)
        PLAY["gated"] = gated = Gated(ctx.backend, n=2)
        ctx = dataclasses.replace(ctx, backend=gated)  # type: ignore[arg-type]
        sample = Sample(uid="q", messages=PROMPT, agent_name="openai_agent")
        traj = await run_sample(sample, ctx)
        await ctx.backend.close()
        return traj

    traj = asyncio.run(go())
    assert traj.stop_reason == "harness_error", traj.error
    assert "returned while its request was in progress" in str(traj.error)
    assert traj.tool_calls == 1


class Failing(Gated):
    """The real backend, whose ``n``-th request fails."""

    async def generate(self, request: Any) -> Any:
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("the backend failed")
        return await self.backend.generate(request)


@CHATML
def test_a_request_the_backend_fails_ends_its_episode(setup: dict[str, Any]) -> None:
    """500, and the episode ends as the tool loop's would (agent_error, the traceback kept);
    a later request is answered 409 (before: the session stayed open mid-turn)."""

    async def go() -> tuple[Session, bytes, bytes]:
        ctx = await _context(setup, CONFIG, None)
        ctx = dataclasses.replace(ctx, backend=Failing(ctx.backend, n=1))  # type: ignore[arg-type]
        session = _fresh(ctx, "fails")
        body = json.dumps({"messages": PROMPT, "tools": ctx.builder.tools}).encode()
        async with serve({"fails": session}) as base_url:
            failed = await _post(_port(base_url), "fails", body)
            again = await _post(_port(base_url), "fails", body)
        await ctx.backend.close()
        return session, failed, again

    session, failed, again = asyncio.run(go())
    assert _status(failed) == 500 and b"episode has ended" in failed
    assert _status(again) == 409
    assert session.finish() == "agent_error" and "the backend failed" in str(session.traj.error)


@CHATML
def test_a_huge_user_message_is_cut_before_it_is_tokenized(setup: dict[str, Any]) -> None:
    """A harness passing on 3 MB of a command's output as a user message: it is cut to
    agent.max_observation_chars, as an environment's message is (before: tokenized whole,
    holding the event loop for seconds)."""
    config = dataclasses.replace(CONFIG, max_observation_chars=1000)

    async def go() -> Session:
        ctx = await _context(setup, config, None)
        session = _fresh(ctx, "big")
        tools = ctx.builder.tools
        async with serve({"big": session}) as base_url:
            port = _port(base_url)
            messages: list[dict[str, Any]] = list(PROMPT)
            turn = _reply(
                await _post(
                    port, "big", json.dumps({"messages": messages, "tools": tools}).encode()
                )
            )
            (call,) = turn["tool_calls"]
            messages += [turn, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
            messages.append(
                _reply(
                    await _post(
                        port, "big", json.dumps({"messages": messages, "tools": tools}).encode()
                    )
                )
            )
            messages.append({"role": "user", "content": "y" * 3 * 2**20})
            await _post(port, "big", json.dumps({"messages": messages, "tools": tools}).encode())
        await ctx.backend.close()
        return session

    session = asyncio.run(go())
    said = [m for m in session.traj.messages if m["role"] == "user"][-1]["content"]
    assert len(said) == 1000 and said.startswith("y") and "cut to 1000" in said
    assert session.traj.cut_observations == 1


@CHATML
def test_run_tool_refuses_once_the_episode_has_ended(setup: dict[str, Any]) -> None:
    """A harness's task left running after it returned cannot run tools for the trajectory
    (its tool state was released: before, the call ran and made new state no one released)."""

    async def go() -> None:
        ctx = await _context(setup, CONFIG, None)
        session = _fresh(ctx, "ended")
        session.stop = "eos"
        call = {"id": "call_1_0", "function": {"name": "echo", "arguments": '{"text": "x"}'}}
        with pytest.raises(openai_endpoint.EpisodeEndedError):
            await session.run_tool(call)
        await ctx.backend.close()

    asyncio.run(go())


@CHATML
def test_run_tool_runs_only_the_calls_the_model_made(setup: dict[str, Any]) -> None:
    """``run_tool`` ran any call a harness passed as the model's: one the model never made,
    one whose arguments the harness changed, or one run already. Each is now a harness error;
    the model's own call, as it made it, runs once."""

    async def go() -> None:
        ctx = await _context(setup, CONFIG, None)
        session = _fresh(ctx, "made")
        call = {"id": "call_1_0", "function": {"name": "echo", "arguments": '{"text": "x"}'}}
        with pytest.raises(HarnessError, match=r"'call_1_0' is no call of the model's last turn"):
            await session.run_tool(call)  # (no turn yet)
        made = ParsedCall("echo", {"text": "x"})
        session.pending = openai_endpoint._Calls([], "", [made], ["call_1_0"], 0.0)
        changed = {"id": "call_1_0", "function": {"name": "echo", "arguments": '{"text": "y"}'}}
        with pytest.raises(HarnessError, match=r"the model's call of echo with \{.text.: .x.\}"):
            await session.run_tool(changed)
        assert await session.run_tool(call) == " ".join(["x"] * 10)
        with pytest.raises(HarnessError, match="no call of the model's last turn left to run"):
            await session.run_tool(call)  # (run already)
        await ctx.backend.close()

    asyncio.run(go())


@CHATML
def test_a_prompt_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(
    setup: dict[str, Any],
) -> None:
    """A first request of more characters than engine.max_model_len tokens could hold (each
    at most the tokenizer's longest token, in characters): 400 naming the limit, the session
    ends before anything is tokenized (before: tokenized whole on the event loop, 3 MB in
    seconds, then ended by max_model_len)."""

    async def go() -> tuple[Session, bytes, int]:
        ctx = await _context(setup, CONFIG, None)
        session = _fresh(ctx, "long")
        limit = ctx.tokenizer.max_token_chars * CONFIG.max_model_len
        messages = [{"role": "user", "content": "y" * (limit + 1)}]
        body = json.dumps({"messages": messages, "tools": ctx.builder.tools}).encode()
        async with serve({"long": session}) as base_url:
            answer = await _post(_port(base_url), "long", body)
        await ctx.backend.close()
        return session, answer, limit

    session, answer, limit = asyncio.run(go())
    assert _status(answer) == 400 and f"at most {limit} characters".encode() in answer
    assert b"engine.max_model_len" in answer
    assert session.stop == "harness_error" and session.traj.prompt_ids == []
    # the bound: no token's text is longer than max_token_chars
    tok = setup["tokenizer"]
    assert max(len(tok.decode([i])) for i in range(tok.vocab_size)) <= tok.max_token_chars


class Recorded(TurnBuilder):
    """The chat template's renders as they are, and the threads they ran in."""

    def __init__(self, builder: TurnBuilder) -> None:
        super().__init__(builder.tokenizer, builder.tools, **builder.template_kwargs)
        self.threads: list[int] = []

    def prompt_ids(self, messages: Any) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().prompt_ids(messages)


@CHATML
def test_a_request_of_many_messages_is_rendered_off_the_event_loop(
    setup: dict[str, Any],
) -> None:
    """A request may hold as many messages as max_model_len tokens; the template rendered
    them on the event loop (32k messages: seconds), holding every other episode of the step.
    The prompt renders in a worker thread; the episode is the same."""

    async def go() -> tuple[Session, Recorded, bytes, int, list[dict[str, str]]]:
        ctx = await _context(setup, CONFIG, None)
        builder = Recorded(ctx.builder)
        session = _fresh(dataclasses.replace(ctx, builder=builder), "many")
        messages = [{"role": "user", "content": "1"}] * (CONFIG.max_model_len // 16) + PROMPT
        body = json.dumps({"messages": messages, "tools": ctx.builder.tools}).encode()
        async with serve({"many": session}) as base_url:
            answer = await _post(_port(base_url), "many", body)
        await ctx.backend.close()
        return session, builder, answer, threading.get_ident(), messages

    session, builder, answer, loop_thread, messages = asyncio.run(go())
    assert _status(answer) == 200
    assert builder.threads and loop_thread not in builder.threads
    assert session.traj.prompt_ids == builder.prompt_ids(messages)


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "function", "function": {"name": "f\ud800", "parameters": {}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"\udc00": {}}}}],
        [{"type": "function", "function": {"name": "f", "description": ["\ud83d"]}}],
    ],
)
def test_a_lone_surrogate_in_the_tools_of_a_request_is_the_harness_error(
    tools: list[dict[str, Any]],
) -> None:
    """The tools go into the prompt, whose tokenizer takes no lone surrogate: checked as the
    messages are, they were rendered, and the tokenizer's TypeError ended the episode as the
    endpoint's own failure (``agent_error``, answered 500) rather than the request's (400)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with pytest.raises(HarnessError, match="tools hold a lone surrogate") as refused:
        check_request(json.loads(json.dumps(body)))
    assert refused.value.status == 400
    paired = json.loads('"\\ud83d\\ude00"')  # a surrogate pair, read as JSON writes it
    pair = [{"type": "function", "function": {"name": "f", "description": paired}}]
    assert paired == "\U0001f600" and check_request({**body, "tools": pair})[1] == pair


def _tools_nested(depth: int) -> str:
    """A first request whose one tool's parameters are lists ``depth`` deep."""
    tools = '[{"type": "function", "function": {"name": "f", "parameters": ' + "[" * depth
    return (
        f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": {tools}{"]" * depth}}}}}]}}'
    )


def _complete(raw: str) -> Any:
    """What `Session.complete` does with a body: reads it, then checks it a call deeper."""
    return _checked(json.loads(raw))


def _checked(body: Any) -> Any:
    return check_request(body)


def test_tools_nested_as_deep_as_the_body_reader_reads_are_the_harness_error() -> None:
    """A first request's tools nested as deep as the endpoint's JSON reader reads: refused as
    the request's error (400). Before: nested past Python's stack they failed in the check's
    own encoding, and at ~490 levels, past it, in rendering the prompt (`TurnBuilder`'s
    defusing of every string): a RecursionError, the endpoint's own failure (500,
    ``agent_error``, untrained) rather than the request's."""
    depth = 2_000
    while True:  # the deepest body read
        try:
            with pytest.raises(HarnessError, match=f"tools nest deeper than {MAX_TOOLS_DEPTH}"):
                _complete(_tools_nested(depth))
            break
        except RecursionError:  # (the reader's)
            depth -= 1
    assert depth > 100
    for depth in (490, MAX_TOOLS_DEPTH - 2):  # the tool list, its object, its function: 3
        with pytest.raises(HarnessError, match="nest deeper"):
            _complete(_tools_nested(depth))
    assert _complete(_tools_nested(MAX_TOOLS_DEPTH - 3))[1] is not None


async def _first_request(setup: dict[str, Any], key: str, body: bytes) -> tuple[Session, bytes]:
    """A fresh session's answer to ``body``, its first request, over HTTP."""
    ctx = await _context(setup, CONFIG, None)
    session = _fresh(ctx, key)
    async with serve({key: session}) as base_url:
        answer = await _post(_port(base_url), key, body)
    await ctx.backend.close()
    return session, answer


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_lone_surrogate_in_a_first_requests_tools_ends_its_episode_as_a_harness_error(
    setup: dict[str, Any],
) -> None:
    tools = '[{"type": "function", "function": {"name": "f\\ud800", "parameters": {}}}]'
    body = f'{{"messages": {json.dumps(PROMPT)}, "tools": {tools}}}'.encode()
    session, answer = asyncio.run(_first_request(setup, "surrogate", body))
    assert _status(answer) == 400 and b"tools hold a lone surrogate" in answer
    assert session.stop == "harness_error" and session.traj.prompt_ids == []


@pytest.mark.parametrize(
    ("number", "problem"),
    [("NaN", b"NaN is not a JSON number"), ("1e999", b"1e999 is past a float's range")],
)
@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_request_body_of_numbers_strict_json_has_not_is_refused(
    setup: dict[str, Any], number: str, problem: bytes
) -> None:
    """``NaN`` and ``1e999`` (Python's reader takes them; no OpenAI client writes them) in a
    first request's tools were rendered into the prompt as no strict reader reads them back,
    and a NaN, unequal to itself, made every later request's tools differ from the first's: a
    harness error on the second request naming the wrong problem."""
    schema = '{"type": "number", "default": ' + number + "}"
    tools = (
        '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
        f'"properties": {{"x": {schema}}}}}}}}}]'
    )
    body = f'{{"messages": {json.dumps(PROMPT)}, "tools": {tools}}}'.encode()
    json.loads(body)  # (Python's reader takes it)
    session, answer = asyncio.run(_first_request(setup, "strict", body))
    assert _status(answer) == 400 and problem in answer
    assert session.stop == "harness_error" and session.traj.prompt_ids == []
