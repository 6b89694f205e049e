"""What the tool server and its client agree on: namespaces, the caps of one request, the
bearer token's comparison, the request bodies and the Unix socket's frames.

Tool state is keyed by (namespace, ``trajectory_id``) (`state_key`), so clients whose
trajectory ids collide (two runs sharing a server) never share or release each other's state.
The namespace travels in the ``X-Tool-Namespace`` header (on the Unix socket, in the hello
frame); each `HttpTools` makes a random one when it is created. A request without one is in the
unnamed namespace, which such clients share (verl-tool's clients, or anyone calling the routes
by hand): their ids must not collide; a proxy in front can give each of them a namespace.
`RequestCaps` bounds what one request carries: the bytes of an id, the calls of a batch, the
calls of a verl-tool action.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import re
import struct
from typing import Annotated, Any

from fastapi import Depends, Header
from pydantic import BaseModel, Field

from jax_agent_rl.config import ToolServerSection

NAMESPACE_HEADER = "X-Tool-Namespace"
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_-]{0,64}")  # no "/": `state_key` stays one-to-one

# Idle keep-alive connections close after this. It is longer than httpx's 5 s keep-alive
# expiry, so a client (`HttpTools`) always drops a pooled connection before the server does
# and never sends a call on a connection the server is closing.
KEEP_ALIVE_S = 15

FRAME_HEAD = struct.Struct(">I")  # the Unix-socket transport's frame: this length, then JSON


@dataclasses.dataclass(frozen=True)
class RequestCaps:
    """What one request may carry; past a cap the request is refused with an error naming it
    (`RequestRefusedError`, HTTP 422), except ``max_action_calls`` (below).

    - ``max_id_bytes``: a trajectory id's bytes (UTF-8): ids are held as long as their state.
      An empty id is refused: every client that sent one would share its state.
    - ``max_batch_calls``: calls of one ``/execute_batch`` and trajectories of one
      ``/get_observation`` (all run at once). `HttpTools` batches ``max_batch`` calls (32).
    - ``max_action_calls``: tool calls one verl-tool action holds. The model wrote them, so
      an action over the cap fails alone: none of its calls runs, and its observation is an
      error the model reads (invalid); the request's other trajectories go on.
    """

    max_id_bytes: int = ToolServerSection.max_id_bytes
    max_batch_calls: int = ToolServerSection.max_batch_calls
    max_action_calls: int = ToolServerSection.max_action_calls

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(
                    f"{field.name} must be at least 1, got {getattr(self, field.name)}"
                )

    def check_id(self, trajectory_id: str) -> None:
        if not trajectory_id:  # every client sending one would share one state
            raise RequestRefusedError("an empty trajectory id: name the trajectory")
        n = len(trajectory_id.encode("utf-8", "surrogatepass"))
        if n > self.max_id_bytes:
            raise RequestRefusedError(
                f"a trajectory id of {n} bytes, over the cap of {self.max_id_bytes} bytes "
                "(max_id_bytes)"
            )

    def check_batch(self, n: int, what: str) -> None:
        if n > self.max_batch_calls:
            raise RequestRefusedError(
                f"{n} {what} in one request, over the cap of {self.max_batch_calls} "
                "(max_batch_calls)"
            )


DEFAULT_CAPS = RequestCaps()  # the caps of `ToolServerSection`'s defaults


class RequestRefusedError(ValueError):
    """A request past a `RequestCaps` cap, or with a malformed namespace (HTTP 422)."""


def state_key(namespace: str, trajectory_id: str) -> str:
    """The key of a trajectory's state on the server (what a tool's ``create`` receives as its
    trajectory id): one-to-one, since a namespace holds no ``/``."""
    return f"{namespace}/{trajectory_id}"


def checked_namespace(namespace: str | None) -> str:
    """``namespace`` (none: the unnamed one, ""); refuses one that is not 0-64 characters of
    ``A-Z a-z 0-9 _ -``."""
    if namespace is None:
        return ""
    if not NAMESPACE_PATTERN.fullmatch(namespace):
        raise RequestRefusedError(
            f"a namespace must be 0-64 characters of A-Z a-z 0-9 _ - ({NAMESPACE_HEADER})"
        )
    return namespace


async def _namespace(
    x_tool_namespace: str | None = Header(default=None, alias=NAMESPACE_HEADER),
) -> str:
    return checked_namespace(x_tool_namespace)


# a route's parameter of this type is the request's namespace (refused with 422 if malformed)
RequestNamespace = Annotated[str, Depends(_namespace)]


def token_matches(sent: str | None, token: str | None) -> bool:
    """Whether a client that sent ``sent`` may call a server whose token is ``token`` (any
    client, when it has none): a constant-time comparison, the one both transports use."""
    if token is None:
        return True
    if sent is None:
        return False
    return hmac.compare_digest(
        sent.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass")
    )


class ExecuteRequest(BaseModel):
    trajectory_id: str
    name: str
    arguments: Any = None
    create_kwargs: dict[str, Any] = Field(default_factory=dict)


class ReleaseRequest(BaseModel):
    trajectory_id: str


class BatchRequest(BaseModel):
    calls: list[ExecuteRequest]


def frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return FRAME_HEAD.pack(len(body)) + body
