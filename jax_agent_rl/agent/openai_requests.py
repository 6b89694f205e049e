"""What a request to the OpenAI-compatible endpoint (`jax_agent_rl.agent.openai_endpoint`) may
hold, checked (`check_request`), the session it names (`session_key`, `find_session`), and a
message's parts in one form however a client spells them (`canonical`); and the shapes of
OpenAI's answers the endpoint writes (`tool_call_message`, `error_response`); what a harness
gets (`HarnessTask`), the harness ``agent.harness`` names (`harness_function`), and a
request's messages rendered off the event loop (`rendered`)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from jax_agent_rl.console.visible import lone_surrogate
from jax_agent_rl.tokenization import Message
from jax_agent_rl.tokenization.tool_calls import ParsedCall
from jax_agent_rl.usercode.load import load_function

T = TypeVar("T")
MAX_TOOLS_BYTES = 256 * 2**10  # the first request's tools, as JSON: past this, refused (400)
# the deepest tools a request may nest (objects and lists): a real schema nests a few levels;
# at ~490 the prompt's rendering ran out of Python's stack (a 500, the episode untrained)
MAX_TOOLS_DEPTH = 64
ROLES = ("system", "user", "assistant", "tool")
# Request fields that would change sampling, which is the run's (sampling.*, agent.*): a
# request setting one (to anything but null or the value listed) is refused. The endpoint
# reads messages, tools, tool_choice, stream, n and parallel_tool_calls (the last four only
# at their defaults) and ignores every other field (model, user, metadata, store,
# service_tier, stream_options, prompt_cache_key, ...).
SAMPLING: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "seed", "stop"), ()),
    **dict.fromkeys(("max_tokens", "max_completion_tokens", "logit_bias", "top_logprobs"), ()),
    **dict.fromkeys(("frequency_penalty", "presence_penalty", "repetition_penalty"), ()),
    **dict.fromkeys(("response_format", "reasoning_effort", "verbosity", "prediction"), ()),
    **dict.fromkeys(("audio", "web_search_options", "functions", "function_call"), ()),
    "logprobs": (False,),
    "modalities": (["text"],),
}


class HarnessError(ValueError):
    """A request its session cannot take: answered ``status`` (400, or 413 / 408 for a body
    too large or too slow), and the session's episode ends."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


def check_request(body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A request's messages and tools, checked; `HarnessError` says what is wrong."""
    if not isinstance(body, dict):
        raise HarnessError("the request body must be a JSON object")
    sampling = sorted(
        f for f in set(body) & set(SAMPLING) if body[f] is not None and body[f] not in SAMPLING[f]
    )
    if sampling:
        raise HarnessError(
            f"the request sets {sampling}: the endpoint samples as the run is set (sampling.*, "
            "agent.*), so requests carry no sampling fields"
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
        if not isinstance(m.get("tool_call_id", ""), str | None):
            raise HarnessError(f"message {i}'s tool_call_id must be a string")
        where = lone_surrogate(message_text(m))  # (JSON's "\ud800" escape: no tokenizer takes it)
        if where is not None:
            raise HarnessError(f"message {i}'s content holds a lone surrogate {where}: not text")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise HarnessError("tools must be a list of objects")
    where = lone_surrogate(tools)  # (rendered into the prompt, it failed in the tokenizer: a 500)
    if where is not None:
        raise HarnessError(f"the request's tools hold a lone surrogate {where}: not text")
    if nesting(tools) > MAX_TOOLS_DEPTH:
        raise HarnessError(f"the request's tools nest deeper than {MAX_TOOLS_DEPTH} levels")
    return messages, tools or None


def nesting(value: Any) -> int:
    """How deep ``value`` (parsed JSON) nests objects and lists (0: a scalar), counted
    without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend(
                (v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def session_key(headers: dict[str, str]) -> str:
    """The session a request names: its ``X-Session-Id`` header, else its bearer API key."""
    key = headers.get("x-session-id")
    if key:
        return key
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def find_session(sessions: Mapping[str, T], key: str) -> T | None:
    """The session of ``key``, compared with every session's key in constant time."""
    found = None
    for k, session in sessions.items():
        if hmac.compare_digest(k.encode(), key.encode()):
            found = session
    return found


def message_text(message: dict[str, Any]) -> str:
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


def canonical(message: dict[str, Any]) -> tuple[Any, ...]:
    """What of a message the model's tokens hold (its role, text, calls and the call it
    answers), in one form however a client spells it."""
    calls = message.get("tool_calls") or []
    try:
        canonical_calls = [
            (c["id"], c["function"]["name"], arguments_value(c["function"]["arguments"]))
            for c in calls
        ]
    except (KeyError, TypeError):
        raise HarnessError(
            "malformed tool_calls (each needs an id, a name and arguments)"
        ) from None
    return (
        message.get("role"),
        message_text(message),
        canonical_calls,
        message.get("tool_call_id"),
    )


def arguments_value(arguments: Any) -> Any:
    """A call's arguments as JSON values (clients re-serialize them with their own spacing)."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError, RecursionError):
        return arguments


def tool_call_message(call: ParsedCall, call_id: str) -> dict[str, Any]:
    """A well-formed call of the model's as an OpenAI ``tool_calls`` entry."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


def error_response(status: int, message: str, code: str) -> tuple[int, dict[str, Any]]:
    """An error in OpenAI's shape, with its HTTP status."""
    return status, {"error": {"message": message, "type": "invalid_request_error", "code": code}}


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


async def rendered(
    render: Callable[[list[Message]], list[int]], messages: list[Message]
) -> list[int]:
    """``render(messages)`` in a worker thread: a request may hold as many messages as
    ``engine.max_model_len``, which the chat template renders for seconds (32k messages: about
    6 s), and on the event loop that held every other episode of the step. Nothing of the
    session changes until it returns, so a request cancelled meanwhile leaves none half done."""
    return await asyncio.to_thread(render, messages)
