"""An OpenAI-compatible endpoint over the rollout backend: the agent loop ``openai_agent``.

Any harness that speaks OpenAI's chat API (the official ``openai`` client, LangChain's
``ChatOpenAI``, an agent framework over either) drives an episode through
``POST /v1/chat/completions``; each session, named by the request's bearer API key or its
``X-Session-Id`` header, is one token-exact `Trajectory`. The harness's messages are never
re-tokenized where the model wrote them:

- The first request is the prompt: its messages (system and user only) and its ``tools``,
  rendered by the chat template (`TurnBuilder.prompt_ids`).
- A later request that repeats one of the session's conversations exactly (every earlier
  message, every assistant message as the endpoint returned it: content and tool calls; the
  same tools) and then adds messages goes on with that conversation: after a turn with tool
  calls, the ``tool`` messages answering each call (by ``tool_call_id``); after a turn without
  calls, ``user`` messages. Those become the template delta after the model's sampled tokens
  (mask 0: `record_results`, `TurnBuilder`), exactly as in `run_tool_agent`; like an
  environment's messages, the user messages are cut to ``agent.max_observation_chars`` before
  they are tokenized (`env_observation`), so that a harness passing on huge text (a command's
  output) cannot hold the event loop.
- A later request that extends none of them (the harness compacted its context, stripped its
  earlier thinking, rewrote a turn, or asks a sub-agent's question in a context of its own)
  starts a new conversation and a new sample of the trajectory (`Trajectory.start_sample`):
  its messages rendered by the chat template as a prompt (each assistant message as its text,
  which holds the model's calls as it wrote them, less its end-of-turn token: a harness that
  rewrites a call rewrites that text), context with mask 0. The conversations left
  stay open: a request that extends one again (the parent after its sub-agent answered) goes
  on in its sample (`Trajectory.resume_sample`). Every sampled token stays where it was
  sampled, each sample token-exact (docs/agents.md).
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

A request that the endpoint cannot take (not strict JSON:
``NaN``, ``Infinity`` and ``1e999`` are no numbers; no messages, an unknown role, a sampling
field, a second request while one is in progress, streaming, tools holding a lone surrogate:
`jax_agent_rl.agent.openai_requests`; a first request of more characters than
``engine.max_model_len`` tokens could hold, refused before it is tokenized), is answered 400
with what was wrong (413 for a body too large, 408 for one too slow), and its session's episode
ends there as a harness failure (`Session.fail`, below); other sessions go on. Error messages
name what differs, never quoting a turn. A request naming no open session is answered 401
from its headers: its body is never read and no session is touched. Once an episode has ended
(a budget, a failure), further requests are answered 409 and change nothing, and
`HarnessTask.run_tool` raises; the harness, which has nothing left to do, is then cancelled
(`usercode.threads.until_set`): one retrying every error held its episode, and the step, for ever.
So is one that has not returned ``AFTER_END_S`` after its episode ended, asking nothing, and
one holding its live episode ``agent.harness_timeout_s`` without a request (`nothing_left`).
A request the backend fails is answered 500 and ends the episode with ``agent_error`` (as in
the tool loop); one still in progress when the harness returns ends it with ``harness_error``.

The harness: ``agent.harness`` names an async function taking a `HarnessTask` (the base URL,
the session's API key, the sample's messages and the tools' schemas), run in a thread and
event loop of its own (`harness_thread`: one blocking its thread holds no other episode);
``openai_agent`` serves the endpoint on a free loopback port while it runs, one session for
the episode, under `LIMITS` (`jax_agent_rl.agent.endpoint_http`: connections, header and
body timeouts, body size, and a bounded shutdown, so a request left open cannot hold the
episode). The key is random (``secrets.token_urlsafe``) and compared in constant time:
another episode's harness cannot guess it, whatever it knows of the trajectory's uid or port.
The harness may run the calls itself (its tool messages carry the results) or through the
run's tools with `HarnessTask.run_tool`, which keeps each result's reward and flags. An
exception out of the harness, or a request the endpoint refuses, ends the episode with
``harness_error`` (its traceback or reason in ``error``) before any model turn reached it, and
after one with ``caused_error``: the policy's text is what changed (the harness's parser
raised on it; the refused request held its own tool's huge output, an echo of a lone surrogate
in the policy's arguments), the harness cannot be run again to tell, and left untrained such
an episode escaped the negative advantage of a wrong answer; trained, outcome 0
(docs/harness.md). An episode that had already ended keeps its stop reason (the harness's
error is added to ``error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

from jax_agent_rl.agent.context import AgentContext, RefusedCall
from jax_agent_rl.agent.endpoint_http import BodyError, Limits, Request, Response, serve_http
from jax_agent_rl.agent.harness_thread import nothing_left, run_harness
from jax_agent_rl.agent.loop import (
    budget_stop,
    call_tool,
    fits,
    model_turn,
    read_turn,
    record_results,
    run_episode,
)
from jax_agent_rl.agent.observations import env_observation
from jax_agent_rl.agent.openai_requests import (
    MAX_TOOLS_BYTES,
    HarnessError,
    HarnessTask,
    canonical,
    check_request,
    error_response,
    find_session,
    harness_function,
    message_text,
    rendered,
    session_key,
    tool_call_message,
)
from jax_agent_rl.agent.trajectory import StopReason, Trajectory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import Environment
from jax_agent_rl.tokenization.tool_calls import ParsedCall, finite_json_float, no_json_constant
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.row_kwargs import create_kwargs_by_tool
from jax_agent_rl.usercode.threads import until_set

LIMITS = Limits()  # what each episode's endpoint server lets its harness hold (endpoint_http)
# seconds a harness may go on after its episode ended without asking on (to log, to close its
# client): a budget or an error ends the episode whatever the harness awaits; past them it is
# cancelled (`nothing_left`)
AFTER_END_S = LIMITS.shutdown_grace_s


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


@dataclasses.dataclass
class _Conversation:
    """A conversation of the session's other than the one its last request went on with, as
    it was left (its context: its tools' turn builder), kept with its sample's index."""

    ctx: AgentContext
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    pending: _Calls | None
    text_turn: list[int] | None


class Session:
    """One harness conversation as one trajectory (see the module docstring)."""

    def __init__(self, ctx: AgentContext, traj: Trajectory, create_kwargs: dict[str, Any]):
        self.ctx, self.traj, self.create_kwargs = ctx, traj, create_kwargs
        self.conversation: list[dict[str, Any]] | None = None  # None until the first request
        self.tools: list[dict[str, Any]] | None = None  # the first request's
        self.pending: _Calls | None = None
        self.text_turn: list[int] | None = None  # the last turn, when it ended without calls
        self._stop: StopReason | None = None
        self.ended = asyncio.Event()  # set with `stop`
        self.asked_after_end = asyncio.Event()  # a request, a run_tool since: answered 409
        self.busy = False
        self.idle = asyncio.Event()  # set while no request is in progress
        self.idle.set()
        self.asked = asyncio.Event()  # set as a request starts (`held_too_long`)
        self.results: dict[str, ToolResult] = {}  # calls run by `run_tool`, by id
        # the conversations left for another (module doc), by the index of their sample
        self.left: dict[int, _Conversation] = {}

    @property
    def stop(self) -> StopReason | None:
        """How the episode ended; None while it goes on."""
        return self._stop

    @stop.setter
    def stop(self, reason: StopReason | None) -> None:
        self._stop = reason
        if reason is not None:
            self.ended.set()

    async def complete(self, request: Request) -> dict[str, Any]:
        """Answers one request, whose body is read here (one at a time): a chat.completion, or
        raises `HarnessError` (the episode ends here with ``harness_error``) or
        `EpisodeEndedError`."""
        if self.stop is not None:
            raise self._ended()
        if self.busy:
            self.fail("a second request while one of this session is in progress")
        self.busy = True
        self.idle.clear()
        self.asked.set()
        raw = None
        try:
            try:
                raw = await request.body()
            except BodyError as e:
                raise HarnessError(str(e), e.status) from None
            try:  # strict: a NaN in the tools, unequal to itself, made later requests' differ
                body = json.loads(
                    raw, parse_constant=no_json_constant, parse_float=finite_json_float
                )
            except (ValueError, RecursionError) as e:
                raise HarnessError(f"the request body is not JSON ({e})") from None
            return await self._complete(body)
        except HarnessError as e:
            self.fail(str(e), e.status)
        except Exception:  # the backend's: the turn stopped anywhere, so the episode ends here
            self.stop = self.stop or "agent_error"
            self.traj.add_error(f"endpoint error:\n{traceback.format_exc()}")
            raise
        except asyncio.CancelledError:  # closed by the server, past the shutdown's grace: once
            if raw is not None and self.stop is None:  # its body was taken, the turn is cut
                self.stop = "harness_error"
                self.traj.add_error("harness error: it returned while its request was in progress")
            raise
        finally:
            self.busy = False
            self.idle.set()

    def fail(self, reason: str, status: int = 400) -> NoReturn:
        """Ends the episode as the harness's failure and raises `HarnessError` ``reason``:
        ``harness_error`` before any model turn, ``caused_error`` after one (the request holds
        what the policy's text led the harness to write: its tools' output, its rewrites)."""
        self.stop = "caused_error" if self.traj.num_turns else "harness_error"
        self.traj.add_error(f"harness error: {reason}")
        raise HarnessError(reason, status)

    async def _complete(self, body: Any) -> dict[str, Any]:
        messages, tools = check_request(body)
        # every message renders at least one token (its role's marker): more messages than
        # max_model_len cannot fit, and comparing or rendering them held the event loop
        if len(messages) > self.ctx.config.max_model_len:
            raise HarnessError(
                f"the request's {len(messages)} messages cannot fit engine.max_model_len="
                f"{self.ctx.config.max_model_len} tokens (each takes one at least)"
            )
        if self.conversation is None:
            await self._start(messages, tools)
        elif (sample := self._extended(messages, tools)) is None:
            await self._new_context(messages, tools)
        else:
            self._go_back(sample)
            observation, stop = await self._observation(self._new_messages(messages))
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
                tool_calls = [tool_call_message(c, i) for c, i in zip(calls, ids, strict=True) if i]
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

    async def _start(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """The first request: its messages and tools are the prompt (rendered in a thread:
        `rendered`)."""
        roles = {m["role"] for m in messages}
        if not roles <= {"system", "user"}:
            raise HarnessError(f"the first request holds only system and user messages: {roles}")
        prompt = [{"role": m["role"], "content": message_text(m)} for m in messages]
        self.traj.set_prompt(prompt, await self._prompt(prompt, tools))
        self.conversation, self.tools = [dict(m) for m in messages], tools

    async def _new_context(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """A request that extends none of the session's conversations: a new one, and a new
        sample from its messages' render (module doc); the conversation so far is left."""
        if messages[-1]["role"] == "assistant":
            raise HarnessError(
                "a request that goes on with none of the session's conversations ends with an "
                "assistant message: there is nothing for the model to answer"
            )
        eos = self.ctx.tokenizer.eos_token or ""  # (the template ends the turn itself)
        said = [
            {"role": m["role"], "content": message_text(m)}
            if m["role"] != "assistant"
            else {"role": "assistant", "content": message_text(m).removesuffix(eos)}
            for m in messages
        ]
        left = _Conversation(self.ctx, self.conversation or [], self.tools, None, None)
        left.pending, left.text_turn = self.pending, self.text_turn
        prompt = await self._prompt(said, tools)
        self.left[self.traj.sample] = left
        self.traj.start_sample(prompt)
        self.traj.add_messages(said)
        self.conversation, self.tools = [dict(m) for m in messages], tools
        self.pending = self.text_turn = None

    async def _prompt(
        self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """``messages`` (text) rendered as a prompt with ``tools`` (in a thread: `rendered`),
        the context's turn builder made for those tools; refused before rendering when they
        cannot fit."""
        if len(json.dumps(tools)) > MAX_TOOLS_BYTES:
            raise HarnessError(f"the request's tools are over {MAX_TOOLS_BYTES} bytes of JSON")
        # A prompt of more characters than max_model_len tokens could hold, each token at most
        # the tokenizer's longest (`Tokenizer.max_token_chars`), cannot fit the context:
        # refused here, before tokenizing it whole would hold the event loop (3 MB: seconds).
        limit = self.ctx.tokenizer.max_token_chars * self.ctx.config.max_model_len
        chars = sum(len(m["content"]) for m in messages)
        if chars > limit:
            raise HarnessError(
                f"the prompt's {chars} characters cannot fit engine.max_model_len="
                f"{self.ctx.config.max_model_len} tokens (at most {limit} characters, "
                f"{self.ctx.tokenizer.max_token_chars} per token)"
            )
        if (tools or None) != self.ctx.builder.tools:
            self.ctx = dataclasses.replace(
                self.ctx, builder=TurnBuilder(self.ctx.tokenizer, tools or None)
            )
        return await rendered(self.ctx.builder.prompt_ids, messages)

    def _extended(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> int | None:
        """The sample of the conversation ``messages`` go on with (they repeat it, with its
        tools, and add messages): the last request's first, then those left, the latest
        first; None: none."""
        assert self.conversation is not None
        said = [canonical(m) for m in messages]
        open_ = [(self.traj.sample, self.conversation, self.tools)]
        open_ += [(k, c.messages, c.tools) for k, c in sorted(self.left.items(), reverse=True)]
        for sample, conversation, conversation_tools in open_:
            if (
                tools == conversation_tools
                and len(messages) > len(conversation)
                and all(a == canonical(b) for a, b in zip(said, conversation, strict=False))
            ):
                return sample
        return None

    def _go_back(self, sample: int) -> None:
        """Goes on with the conversation left with ``sample`` (none to do: the last one's)."""
        if sample == self.traj.sample:
            return
        assert self.conversation is not None
        left = self.left.pop(sample)
        here = _Conversation(self.ctx, self.conversation, self.tools, self.pending, self.text_turn)
        self.left[self.traj.sample] = here
        self.traj.resume_sample(sample)
        self.ctx, self.conversation, self.tools = left.ctx, left.messages, left.tools
        self.pending, self.text_turn = left.pending, left.text_turn

    def _new_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages after the conversation (`_extended`), added to it."""
        assert self.conversation is not None
        new = messages[len(self.conversation) :]
        self.conversation.extend(dict(m) for m in new)
        return new

    async def _observation(self, new: list[dict[str, Any]]) -> tuple[list[int], StopReason | None]:
        """The tokens of the harness's new messages (tool results or a user's reply, rendered
        in a thread: `rendered`), and the stop reason when the episode ends here (they do not
        fit)."""
        if self.pending is not None:
            return self._answer(new)
        assert self.text_turn is not None
        if any(m["role"] != "user" for m in new):
            raise HarnessError(
                "after a reply without tool calls only user messages may follow, got "
                f"{[m['role'] for m in new]}"
            )
        said = [{"role": "user", "content": message_text(m)} for m in new]
        messages = env_observation(said, self.ctx.config.max_observation_chars, self.traj)
        builder = self.ctx.builder
        delta = await rendered(builder.messages_delta, messages)
        ids = builder.close_assistant_turn(self.text_turn) + delta
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
                results.append(dataclasses.replace(ran, text=message_text(answers[i])))
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

    def _ended(self) -> EpisodeEndedError:
        self.asked_after_end.set()  # (the harness goes on past the end: `until_set` stops it)
        return EpisodeEndedError(f"this session's episode has ended ({self.stop})")

    def _end(self, stop: StopReason, text: str, finish_reason: str) -> dict[str, Any]:
        self.stop = self.stop or stop  # a harness error met meanwhile stays the episode's end
        return self._reply(text, [], finish_reason)

    async def run_tool(self, tool_call: dict[str, Any]) -> str:
        """Runs one of the returned ``tool_calls`` through the run's tools (as the loop runs
        it); its result, reward and flags are used when the tool message answering it comes.
        Raises `EpisodeEndedError` once the episode has ended (the harness has returned);
        one still running then (cancelled or not) releases the tool state it made."""
        if self.stop is not None:
            raise self._ended()
        call = self._made(tool_call)
        try:
            result = await call_tool(self.ctx, self.traj, call, self.create_kwargs)
        finally:  # (past the episode's release, a call that waited for a slot made it anew)
            if self.stop is not None:
                await self.ctx.tools.release(self.traj.uid)
        self.results[tool_call["id"]] = result
        return result.text

    def _made(self, tool_call: dict[str, Any]) -> ParsedCall:
        """The model's call ``tool_call`` names: one of its last turn's, not yet run, with the
        name and arguments the model gave; else a `HarnessError` (a harness's call the model
        never made, or changed, was run and answered as the model's)."""
        pending, name = self.pending, tool_call.get("id")
        ids = [] if pending is None else [i for i in pending.ids if i is not None]
        if pending is None or name not in ids or name in self.results:
            raise HarnessError(
                f"run_tool: {name!r:.80} is no call of the model's last turn left to run "
                f"(those: {[i for i in ids if i not in self.results]})"
            )
        made = pending.calls[pending.ids.index(name)]
        function = tool_call.get("function") or {}
        try:
            same = function.get("name") == made.name and (
                json.loads(function.get("arguments") or "null") == made.arguments
            )
        except (TypeError, ValueError):
            same = False
        if not same:
            raise HarnessError(
                f"run_tool: {name} is the model's call of {made.name} with "
                f"{json.dumps(made.arguments)[:200]}, not {json.dumps(function)[:200]}"
            )
        return made

    def finish(self) -> StopReason:
        """How the episode ended, once the harness has returned (it has then ended)."""
        if self.stop is None:
            if self.conversation is None:
                self.fail("the harness never called the endpoint")
            # the harness ended on its tools' results, or on the model's turn without calls
            assert self.pending is not None or self.text_turn is not None
            self.stop = "tool_done" if self.pending is not None else "eos"
        return self.stop


def handler(sessions: dict[str, Session]) -> Callable[[Request], Awaitable[Response]]:
    """``POST /v1/chat/completions`` over ``sessions``, by key (see the module docstring). A
    request naming no session is answered from its headers alone; it touches no session."""

    async def handle(request: Request) -> Response:
        if (request.method, request.target.split("?")[0]) != ("POST", "/v1/chat/completions"):
            only = "the endpoint serves POST /v1/chat/completions only"
            return error_response(404, only, "not_found")
        session = find_session(sessions, session_key(request.headers))
        if session is None:
            unknown = "no open session has this API key or X-Session-Id"
            return error_response(401, unknown, "no_session")
        try:
            return 200, await session.complete(request)
        except HarnessError as e:
            message = f"{e}; this session's episode has ended"
            return error_response(e.status, message, "harness_error")
        except EpisodeEndedError as e:
            return error_response(409, str(e), "episode_ended")
        except Exception as e:  # the backend's: kept in the trajectory, which ended
            message = f"the endpoint failed: {type(e).__name__}; this session's episode has ended"
            return error_response(500, message, "server_error")

    return handle


@contextlib.asynccontextmanager
async def serve(sessions: dict[str, Session], limits: Limits | None = None) -> AsyncIterator[str]:
    """Serves ``sessions`` on a free loopback port, in this event loop (where the backend
    samples), under ``limits`` (default `LIMITS`) while the context is open; yields the base
    URL (``http://127.0.0.1:port/v1``). Leaving it takes at most the limits' grace period."""
    async with serve_http(handler(sessions), limits or LIMITS) as port:
        yield f"http://127.0.0.1:{port}/v1"


async def run_openai_agent(sample: Sample, ctx: AgentContext) -> Trajectory:
    """The episode of ``sample`` driven by the harness ``agent.harness`` names through the
    endpoint: see the module docstring."""
    harness = harness_function(ctx.config.harness)

    async def play(traj: Trajectory, env: Environment | None) -> StopReason:
        del env  # none: run_episode refuses a sample with one (this loop does not drive it)
        session = Session(ctx, traj, create_kwargs_by_tool(sample.extra))
        key = secrets.token_urlsafe(32)  # unguessable: only this episode's harness holds it
        task = HarnessTask(
            base_url="",
            api_key=key,
            messages=[dict(m) for m in sample.messages],
            tools=list(ctx.builder.tools or []),
            run_tool=session.run_tool,
        )
        done = asyncio.Event()
        watch = asyncio.ensure_future(
            nothing_left(session, done, ctx.config.harness_timeout_s, AFTER_END_S)
        )
        async with serve({key: session}) as base_url:
            try:
                running = run_harness(harness, dataclasses.replace(task, base_url=base_url))
                await until_set(running, done, LIMITS.shutdown_grace_s)
            except Exception:  # the harness's own failure, not the loop's
                failed = traceback.format_exc()
                if session.stop is None:
                    session.stop = "caused_error" if traj.num_turns else "harness_error"
                    traj.add_error(f"the harness raised:\n{failed}")
                else:
                    traj.add_error(f"\nthen the harness failed:\n{failed}")
            finally:
                watch.cancel()
        try:
            return session.finish()
        except HarnessError:
            return "harness_error"

    return await run_episode(sample, ctx, play)
