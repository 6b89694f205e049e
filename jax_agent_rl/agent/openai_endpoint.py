"""An OpenAI-compatible endpoint over the rollout backend: the agent loop ``openai_agent``.

Any harness that speaks OpenAI's chat API (the official ``openai`` client, LangChain's
``ChatOpenAI``, an agent framework over either) drives an episode through
``POST /v1/chat/completions``; each session, named by the request's bearer API key or its
``X-Session-Id`` header, is one token-exact `Trajectory`. The harness's messages are never
re-tokenized where the model wrote them:

- The first request is the prompt: its messages (system and user only) and its ``tools``,
  rendered by the chat template (`TurnBuilder.prompt_ids`).
- Each later request must repeat the session's conversation exactly (every earlier message,
  and every assistant message as the endpoint returned it: content and tool calls) and then
  add messages: after a turn with tool calls, the ``tool`` messages answering each call (by
  ``tool_call_id``); after a turn without calls, ``user`` messages. Those become the template
  delta after the model's sampled tokens (mask 0: `record_results`, `TurnBuilder`), exactly as
  in `run_tool_agent`.
- Then one model turn, sampled as the tool loop samples it (`model_turn`: the same budgets,
  stop ids and per-request seeds), read by the context's parser (`read_turn`) and answered as
  an OpenAI ``chat.completion``: ``content`` is the model's whole text, its well-formed calls
  are ``tool_calls`` (ids ``call_<turn>_<i>``, ``arguments`` a JSON string), and
  ``finish_reason`` is ``tool_calls``, ``stop`` (an end of turn) or ``length`` (a budget ended
  the episode). Calls the model wrote malformed, or past ``agent.max_tool_calls_per_turn``, are
  answered by the endpoint as the loop answers them (counted as malformed or refused); a turn
  of malformed calls only is answered and followed by the next turn within the same request.
  So for the same model tokens a harness that runs the calls it is given records token for
  token the trajectory `run_tool_agent` records.

A request that rewrites an earlier turn, or that the endpoint cannot take (not JSON, no
messages, unknown roles or fields, a second request while one is in progress, streaming), is
answered 400 with what was wrong, and its session's episode ends there with stop reason
``harness_error`` (not trainable, counted as ``stop/harness_error``); other sessions go on. A
request naming no open session is answered 401 and ends nothing. Once an episode has ended
(a budget, ``harness_error``), further requests are answered 409 and change nothing.

The harness: ``agent.harness`` names an async function taking a `HarnessTask` (the base URL,
the session's API key, the sample's messages and the tools' schemas); ``openai_agent`` serves
the endpoint on a free loopback port while that function runs, one session for the episode.
The harness may run the calls itself (its tool messages carry the results) or through the
run's tools with `HarnessTask.run_tool`, which keeps each result's reward and flags. An
exception out of the harness ends the episode with ``harness_error`` (its traceback in
``error``), unless it had already ended (it keeps that stop reason; the harness's error is
added to ``error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import socket
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jax_agent_rl.agent.context import AgentContext, RefusedCall
from jax_agent_rl.agent.loop import (
    budget_stop,
    call_tool,
    fits,
    model_turn,
    read_turn,
    record_results,
    run_episode,
)
from jax_agent_rl.agent.trajectory import StopReason, Trajectory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import Environment
from jax_agent_rl.tokenization.tool_calls import ParsedCall
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.verl import create_kwargs_by_tool
from jax_agent_rl.user_code import load_function

MAX_BODY_BYTES = 8 * 2**20  # a request body past this is refused (413) and ends its session
ROLES = ("system", "user", "assistant", "tool")
# the request fields the endpoint takes (stream, n, tool_choice and parallel_tool_calls only
# at their defaults); any other is refused, since sampling is the run's (rollout.*, agent.*)
_FIELDS = {"messages", "tools", "model", "tool_choice", "stream", "n", "parallel_tool_calls"}


class HarnessError(ValueError):
    """A request its session cannot take: answered 400, and the session's episode ends."""


class EpisodeEndedError(ValueError):
    """A request to a session whose episode has ended: answered 409, nothing changes."""


@dataclasses.dataclass
class _Calls:
    """A model turn whose well-formed calls the harness is running."""

    tokens: list[int]
    text: str
    calls: list[ParsedCall]
    ids: list[str | None]  # each call's tool call id; None: malformed or refused, answered here
    started: float  # when the reply left (perf_counter)


class Session:
    """One harness conversation as one trajectory (see the module docstring)."""

    def __init__(self, ctx: AgentContext, traj: Trajectory, create_kwargs: dict[str, Any]):
        self.ctx, self.traj, self.create_kwargs = ctx, traj, create_kwargs
        self.conversation: list[dict[str, Any]] | None = None  # None until the first request
        self.tools: list[dict[str, Any]] | None = None  # the first request's
        self.pending: _Calls | None = None
        self.text_turn: list[int] | None = None  # the last turn, when it ended without calls
        self.stop: StopReason | None = None  # set once the episode has ended
        self.busy = False
        self.results: dict[str, ToolResult] = {}  # calls run by `run_tool`, by id

    async def complete(self, body: Any) -> dict[str, Any]:
        """Answers one request: a chat.completion, or raises `HarnessError` (the episode ends
        here with ``harness_error``) or `EpisodeEndedError`."""
        if self.stop is not None:
            raise EpisodeEndedError(f"this session's episode has ended ({self.stop})")
        if self.busy:
            self.fail("a second request while one of this session is in progress")
        self.busy = True
        try:
            return await self._complete(body)
        except HarnessError as e:
            self.fail(str(e))
        finally:
            self.busy = False

    def fail(self, reason: str) -> NoReturn:
        """Ends the episode with ``harness_error`` and raises `HarnessError` ``reason``."""
        self.stop = "harness_error"
        self.traj.add_error(f"harness error: {reason}")
        raise HarnessError(reason)

    async def _complete(self, body: Any) -> dict[str, Any]:
        messages, tools = _request(body)
        if self.conversation is None:
            self._start(messages, tools)
        else:
            observation, stop = self._observation(self._new_messages(messages, tools))
            if stop is not None:
                return self._end(stop, "", "length")
            self.traj.add_observation(observation)
        while True:
            turn, text, calls, stop = await self._turn()
            if stop == "eos":
                self.text_turn = turn
                return self._reply(text, [], "stop")
            if stop is not None:
                return self._end(stop, text, "length")
            ids = [
                None if c.error is not None else f"call_{self.traj.num_turns}_{i}"
                for i, c in enumerate(calls)
            ]
            if any(i is not None for i in ids):
                self.pending = _Calls(turn, text, calls, ids, time.perf_counter())
                tool_calls = [_tool_call(c, i) for c, i in zip(calls, ids, strict=True) if i]
                return self._reply(text, tool_calls, "tool_calls")
            # every call malformed: answered here, as the loop answers it, and the model goes on
            results = [await call_tool(self.ctx, self.traj, c, self.create_kwargs) for c in calls]
            observation, stop = record_results(self.ctx, self.traj, turn, text, calls, results)
            if stop is not None:
                return self._end(stop, text, "length")
            self.traj.add_observation(observation)

    async def _turn(self) -> tuple[list[int], str, list[ParsedCall], StopReason | None]:
        """One model turn as the tool loop takes it (`take_turn`): its tokens, text and calls,
        and the stop reason when the episode ends with it (or before it: a budget)."""
        stop = budget_stop(self.ctx, self.traj)
        if stop is not None:
            return [], "", [], stop
        turn, finish = await model_turn(self.ctx, self.traj)
        if finish == "budget" and not turn:
            return [], "", [], "budget"
        return turn, *read_turn(self.ctx, self.traj, turn, finish)

    def _start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """The first request: its messages and tools are the prompt."""
        roles = {m["role"] for m in messages}
        if not roles <= {"system", "user"}:
            raise HarnessError(f"the first request holds only system and user messages: {roles}")
        if (tools or None) != self.ctx.builder.tools:
            self.ctx = dataclasses.replace(
                self.ctx, builder=TurnBuilder(self.ctx.tokenizer, tools or None)
            )
        prompt = [{"role": m["role"], "content": _text(m)} for m in messages]
        self.traj.set_prompt(prompt, self.ctx.builder)
        self.conversation, self.tools = [dict(m) for m in messages], tools

    def _new_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """The messages after the session's conversation, which ``messages`` must repeat."""
        assert self.conversation is not None
        if tools != self.tools:
            raise HarnessError("the request's tools differ from the first request's (the prompt)")
        for i, (got, want) in enumerate(zip(messages, self.conversation, strict=False)):
            if _canonical(got) != _canonical(want):
                raise HarnessError(
                    f"message {i} rewrites an earlier turn: got {_canonical(got)}, the "
                    f"conversation holds {_canonical(want)}"
                )
        if len(messages) <= len(self.conversation):
            raise HarnessError(
                f"the request adds no message to the session's {len(self.conversation)}"
            )
        new = messages[len(self.conversation) :]
        self.conversation.extend(dict(m) for m in new)
        return new

    def _observation(self, new: list[dict[str, Any]]) -> tuple[list[int], StopReason | None]:
        """The tokens of the harness's new messages (tool results or a user's reply), and the
        stop reason when the episode ends here (they do not fit)."""
        if self.pending is not None:
            return self._answer(new)
        assert self.text_turn is not None
        if any(m["role"] != "user" for m in new):
            raise HarnessError(
                "after a reply without tool calls only user messages may follow, got "
                f"{[m['role'] for m in new]}"
            )
        messages = [{"role": "user", "content": _text(m)} for m in new]
        builder = self.ctx.builder
        ids = builder.close_assistant_turn(self.text_turn) + builder.messages_delta(messages)
        self.text_turn = None
        self.traj.add_messages(messages)
        return ids, fits(self.ctx, self.traj, ids)

    def _answer(self, new: list[dict[str, Any]]) -> tuple[list[int], StopReason | None]:
        """Records the tool messages answering the pending calls (`record_results`)."""
        pending, self.pending = self.pending, None
        assert pending is not None
        self.traj.add_time("tools_s", time.perf_counter() - pending.started)
        wanted = [i for i in pending.ids if i is not None]
        answers = {m.get("tool_call_id"): m for m in new if m["role"] == "tool"}
        if len(new) != len(wanted) or sorted(answers, key=str) != sorted(wanted):
            raise HarnessError(
                f"after tool calls {wanted} exactly one tool message must answer each, got "
                f"{[(m['role'], m.get('tool_call_id')) for m in new]}"
            )
        results: list[ToolResult] = []
        for call, i in zip(pending.calls, pending.ids, strict=True):
            if i is None:
                results.append(ToolResult(f"error: {call.error}", error=True))
                self.traj.add_unrun_call(refused=isinstance(call, RefusedCall))
            else:
                ran = self.results.pop(i, None) or ToolResult("")
                results.append(dataclasses.replace(ran, text=_text(answers[i])))
        return record_results(
            self.ctx, self.traj, pending.tokens, pending.text, pending.calls, results
        )

    def _reply(
        self, text: str, tool_calls: list[dict[str, Any]], finish_reason: str
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if self.conversation is not None:
            self.conversation.append(message)
        completion = sum(self.traj.loss_mask)
        return {
            "id": f"chatcmpl-{self.traj.uid}-{self.traj.num_turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "policy",
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": len(self.traj.prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(self.traj.prompt_ids) + completion,
            },
        }

    def _end(self, stop: StopReason, text: str, finish_reason: str) -> dict[str, Any]:
        self.stop = stop
        return self._reply(text, [], finish_reason)

    async def run_tool(self, tool_call: dict[str, Any]) -> str:
        """Runs one of the returned ``tool_calls`` through the run's tools (as the loop runs
        it); its result, reward and flags are used when the tool message answering it comes."""
        function = tool_call["function"]
        call = ParsedCall(function["name"], json.loads(function["arguments"]))
        result = await call_tool(self.ctx, self.traj, call, self.create_kwargs)
        self.results[tool_call["id"]] = result
        return result.text

    def finish(self) -> StopReason:
        """How the episode ended, once the harness has returned."""
        if self.stop is not None:
            return self.stop
        if self.conversation is None:
            self.fail("the harness never called the endpoint")
        if self.pending is not None:  # the harness ended on its tools' results
            return "tool_done"
        assert self.text_turn is not None  # else the model's last turn ended the episode
        return "eos"


def _tool_call(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


def _request(body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A request's messages and tools, checked; `HarnessError` says what is wrong."""
    if not isinstance(body, dict):
        raise HarnessError("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise HarnessError(
            f"unsupported fields {unknown}: the endpoint samples as the run is set "
            f"(fields it reads: {sorted(_FIELDS)})"
        )
    if body.get("stream") or body.get("n", 1) != 1 or body.get("parallel_tool_calls") is False:
        raise HarnessError(
            "the endpoint answers one choice, not streamed, with every call the model wrote "
            "(stream, n, parallel_tool_calls)"
        )
    if body.get("tool_choice", "auto") not in ("auto", None):
        raise HarnessError("the endpoint cannot force tool use: the model calls tools as it writes")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HarnessError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise HarnessError(f"message {i} must be an object with a role among {ROLES}")
        _text(m)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise HarnessError("tools must be a list of objects")
    return messages, tools or None


def _text(message: dict[str, Any]) -> str:
    """A message's content as text (None is empty; a list of text parts is joined)."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise HarnessError("a message's content must be a string or a list of text parts")


def _canonical(message: dict[str, Any]) -> tuple[Any, ...]:
    """What of a message the model's tokens hold (its role, text, calls and the call it
    answers), in one form however a client spells it."""
    calls = message.get("tool_calls") or []
    try:
        canonical_calls = [
            (c["id"], c["function"]["name"], _arguments(c["function"]["arguments"])) for c in calls
        ]
    except (KeyError, TypeError):
        raise HarnessError(f"malformed tool_calls {calls!r}") from None
    return (message.get("role"), _text(message), canonical_calls, message.get("tool_call_id"))


def _arguments(arguments: Any) -> Any:
    """A call's arguments as JSON values (clients re-serialize them with their own spacing)."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError, RecursionError):
        return arguments


def _error(status: int, message: str, code: str) -> JSONResponse:
    """An error in OpenAI's shape."""
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return JSONResponse(body, status_code=status)


def _session_key(request: Request) -> str:
    key = request.headers.get("x-session-id")
    if key:
        return key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def create_app(sessions: dict[str, Session]) -> FastAPI:
    """``POST /v1/chat/completions`` over ``sessions``, by key (see the module docstring)."""
    app = FastAPI(title="jax_agent_rl policy endpoint", docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        session = sessions.get(_session_key(request))
        if session is None:
            return _error(401, "no open session has this API key or X-Session-Id", "no_session")
        try:
            raw = bytearray()
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    session.fail(f"the request body is over {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as e:
                session.fail(f"the request body is not JSON ({e})")
            return JSONResponse(await session.complete(body))
        except HarnessError as e:
            return _error(400, f"{e}; this session's episode has ended", "harness_error")
        except EpisodeEndedError as e:
            return _error(409, str(e), "episode_ended")

    return app


@contextlib.asynccontextmanager
async def serve(sessions: dict[str, Session]) -> AsyncIterator[str]:
    """Serves ``sessions`` on a free loopback port, in this event loop (where the backend
    samples), while the context is open; yields the base URL (``http://127.0.0.1:port/v1``)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        create_app(sessions), log_level="warning", access_log=False, lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # its exception
                raise RuntimeError("the endpoint stopped before it started")
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        await task
        sock.close()


@dataclasses.dataclass(frozen=True)
class HarnessTask:
    """What a harness gets for one episode: point an OpenAI client at ``base_url`` with
    ``api_key``, start from ``messages`` (the prompt) and ``tools`` (their schemas in OpenAI's
    format; send them as the requests' ``tools`` so the prompt lists them as the tool loop's
    does), and run the calls yourself or with ``run_tool``."""

    base_url: str
    api_key: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    run_tool: Callable[[dict[str, Any]], Awaitable[str]]


Harness = Callable[[HarnessTask], Awaitable[None]]


@functools.cache
def harness_function(spec: str) -> Harness:
    """The harness ``agent.harness`` names (loaded once)."""
    return load_function(spec, "agent.harness")


async def run_openai_agent(sample: Sample, ctx: AgentContext) -> Trajectory:
    """The episode of ``sample`` driven by the harness ``agent.harness`` names through the
    endpoint: see the module docstring."""
    harness = harness_function(ctx.config.harness)

    async def play(traj: Trajectory, env: Environment | None) -> StopReason:
        del env  # none: run_episode refuses a sample with one (this loop does not drive it)
        session = Session(ctx, traj, create_kwargs_by_tool(sample.extra))
        task = HarnessTask(
            base_url="",
            api_key=traj.uid,
            messages=[dict(m) for m in sample.messages],
            tools=list(ctx.builder.tools or []),
            run_tool=session.run_tool,
        )
        async with serve({traj.uid: session}) as base_url:
            try:
                await harness(dataclasses.replace(task, base_url=base_url))
            except Exception:  # the harness's own failure, not the loop's
                failed = traceback.format_exc()
                if session.stop is None:
                    session.stop = "harness_error"
                    traj.add_error(f"the harness raised:\n{failed}")
                else:
                    traj.add_error(f"\nthen the harness failed:\n{failed}")
        try:
            return session.finish()
        except HarnessError:
            return "harness_error"

    return await run_episode(sample, ctx, play)
