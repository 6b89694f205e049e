"""The tool server (FastAPI over a `ToolRegistry`) and its client, `HttpTools`.

Endpoints: ``GET /health`` (``{"status": "ok"}`` and nothing else: the one route open
without the token), ``GET /tools`` (schemas), ``POST /execute`` (one call; state is sticky per
trajectory; its ``create_kwargs`` reach the tool's ``create``), ``POST /release`` (free a
trajectory's state), ``GET /metrics``, and verl-tool's ``POST /get_observation`` (see
`create_app`); no docs or OpenAPI routes. Calls run through `LocalTools` (per-call timeout,
failures become error results) behind a concurrency cap; when the app stops, every tool is
closed. The server refuses to listen on a non-loopback address without a bearer token, and
compares the token in constant time on both transports (`token_matches`).

Tool state is keyed by (namespace, ``trajectory_id``) (`state_key`), so clients whose
trajectory ids collide (two runs sharing a server) never share or release each other's state.
The namespace travels in the ``X-Tool-Namespace`` header (on the Unix socket, in the hello
frame); each `HttpTools` makes a random one when it is created. A request without one is in the
unnamed namespace, which such clients share (verl-tool's clients, or anyone calling the routes
by hand): their ids must not collide; a proxy in front can give each of them a namespace.
`RequestCaps` bounds what one request carries: the bytes of an id, the calls of a batch, the
calls of a verl-tool action.

What a careless or hostile client can hold is bounded by settings of the server: trajectory
state expires after ``idle_timeout_s`` without a call (a sweep frees it even with no traffic)
and at most ``max_trajectories`` hold state at once (see `LocalTools`); a request body is
refused past ``max_body_bytes`` (413) or when not fully received within ``body_timeout_s``
(408); at most ``max_connections`` connections are served at once (see `serve`).

`HttpTools` is a `ToolExecutor`: the agent loop uses it exactly like `LocalTools`. Calls that
concurrent trajectories make in the same event-loop tick share one ``/execute_batch`` request
(what batched RL tool servers accept), so HTTP costs less per call under load. It retries
only failures where the request cannot have reached the server (connection refused or timed
out while connecting), with exponential backoff; any other transport failure, or retries used
up, raises `ToolTransportError` (the trajectory then ends with stop reason ``tool_error``).

On one machine, ``jarl serve-tools --socket PATH`` also serves the calls on a Unix socket
(`SocketServer`; ``HttpTools("unix:PATH")``): each call is one frame on a long-lived
connection, answered as it ends, so a call costs ~0.2 ms of CPU on both sides where an HTTP
request costs ~1.3 ms (uvicorn + FastAPI, httpx, and the loopback TCP sends and wake-ups).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import itertools
import json
import os
import re
import secrets
import stat
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, model_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jax_agent_rl.tokenization.tool_calls import (
    InlineToolCallParser,
    ParsedCall,
    ToolCallParser,
    make_parser,
)
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry, ToolTransportError
from jax_agent_rl.tools.verl import create_kwargs_by_tool

if TYPE_CHECKING:
    import uvicorn


NAMESPACE_HEADER = "X-Tool-Namespace"
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_-]{0,64}")  # no "/": `state_key` stays one-to-one


@dataclasses.dataclass(frozen=True)
class RequestCaps:
    """What one request may carry; past a cap the request is refused with an error naming it
    (`RequestRefusedError`, HTTP 422), except ``max_action_calls`` (below).

    - ``max_id_bytes``: a trajectory id's bytes (UTF-8): ids are held as long as their state.
    - ``max_batch_calls``: calls of one ``/execute_batch`` and trajectories of one
      ``/get_observation`` (all run at once). `HttpTools` batches ``max_batch`` calls (32).
    - ``max_action_calls``: tool calls one verl-tool action holds. The model wrote them, so
      an action over the cap fails alone: none of its calls runs, and its observation is an
      error the model reads (invalid); the request's other trajectories go on.
    """

    max_id_bytes: int = 256
    max_batch_calls: int = 1024
    max_action_calls: int = 32

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(
                    f"{field.name} must be at least 1, got {getattr(self, field.name)}"
                )

    def check_id(self, trajectory_id: str) -> None:
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


class ObservationRequest(BaseModel):
    """verl-tool's request (``verl_tool/servers/tool_server.py`` ``ActionRequest``): per
    trajectory, an action (the text of a model turn), whether the trajectory is finished,
    whether this is its last step, and its extra fields (the dataset row's ``extra_info``)."""

    trajectory_ids: list[str] = Field(min_length=1)
    actions: list[str]
    finish: list[bool] | None = None
    is_last_step: list[bool] | None = None
    extra_fields: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_item_per_trajectory(self) -> ObservationRequest:
        n = len(self.trajectory_ids)
        for key in ("actions", "finish", "is_last_step", "extra_fields"):
            items = getattr(self, key)
            if items is not None and len(items) != n:
                raise ValueError(f"{key} has {len(items)} items for {n} trajectory_ids")
        return self


def observation_text(parser: ToolCallParser, texts: list[str]) -> str:
    """What verl-tool's client appends after the action: each result as the parser's model
    reads it (an inline parser's output block; for a chat parser, Hermes ``<tool_response>``
    blocks, the content a chat template renders for tool messages)."""
    if parser.style == "inline":
        inline = cast(InlineToolCallParser, parser)
        return "".join(inline.format_output(t) for t in texts)
    return "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)


@dataclasses.dataclass
class ServerMetrics:
    calls: int = 0
    errors: int = 0
    in_flight: int = 0
    releases: int = 0
    call_seconds: float = 0.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BodyTooLargeError(Exception):
    """A request body over the cap."""


class BodyLimit:
    """ASGI middleware that receives each request body whole before the app sees it: a body
    over ``max_bytes`` is answered 413 (at once when its Content-Length says so, else once the
    chunks received pass the cap), and a body not received within ``timeout_s`` (a client
    sending it a byte at a time) is answered 408. Both answers close the connection, since the
    unread rest of the body cannot be skipped safely. A client that disconnects gets nothing.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._body(scope, receive)
        except TimeoutError:
            detail = f"request body not received within {self.timeout_s:g}s (body_timeout_s)"
            await _refuse(scope, receive, send, 408, detail)
            return
        except BodyTooLargeError:
            detail = f"request body over the cap of {self.max_bytes} bytes (max_body_bytes)"
            await _refuse(scope, receive, send, 413, detail)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None if the client went away; raises `BodyTooLargeError`."""
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            raise BodyTooLargeError
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                raise BodyTooLargeError
            if not message.get("more_body", False):
                return bytes(body)


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, detail: str) -> None:
    response = JSONResponse({"detail": detail}, status_code=status, headers={"connection": "close"})
    await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then the client's later messages
    (a disconnect, which a streaming response listens for)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def sweep_idle(
    tools: LocalTools, every_s: float, sleep: Callable[[float], Awaitable[object]]
) -> None:
    """Expires idle trajectories every ``every_s`` seconds, so that their state is freed even
    when no call comes to expire it; runs until cancelled."""
    while True:
        await sleep(every_s)
        await tools.expire_idle()


FRAME_HEAD = struct.Struct(">I")  # the Unix-socket transport's frame: this length, then JSON


def frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return FRAME_HEAD.pack(len(body)) + body


def private_socket_path(path: str) -> str:
    """``path``, checked for serving on: its directory is this user's and closed to everyone
    else (mode 0700 or stricter), and nothing but a stale socket of ours is there already
    (which is removed). Raises ValueError otherwise."""
    where = Path(path).absolute().parent
    st = where.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"refusing to serve on socket {path}: its directory {where} must be owned by this "
            f"user and closed to others (chmod 700), is uid {st.st_uid} mode {st.st_mode & 0o777:o}"
        )
    with contextlib.suppress(FileNotFoundError):
        old = os.lstat(path)
        if not stat.S_ISSOCK(old.st_mode) or old.st_uid != os.getuid():
            raise ValueError(f"refusing to serve on socket {path}: something else is there")
        Path(path).unlink()
    return path


@dataclasses.dataclass(frozen=True)
class SocketLimits:
    """What one client of the Unix socket can hold (the HTTP side's bounds, per frame):
    a frame over ``max_frame_bytes`` or whose body is not received within ``frame_timeout_s``
    closes the connection; at most ``max_in_flight`` calls run per connection (no further
    frame is read until one ends) and ``max_connections`` connections are served at once; a
    connection with no call in flight that sends nothing for ``idle_s`` is closed."""

    max_frame_bytes: int
    frame_timeout_s: float
    max_in_flight: int
    max_connections: int
    idle_s: float


class SocketServer:
    """The tool server's Unix-socket transport: the calls of `HttpTools` ("unix:" URLs) as
    frames on one long-lived connection, many in flight at once and answered as each ends,
    with no per-call HTTP request (what makes a call cheap).

    A frame is a 4-byte big-endian length and a JSON object. The client's first frame is
    ``{"token": ..., "namespace": ...}``: with a server token, a wrong or missing one is
    answered ``{"error": ...}`` and the connection closed, as is a malformed namespace (see
    `checked_namespace`; none: the unnamed one); else ``{"ok": true}``, and every request of the
    connection is in that namespace. Then each request is ``{"id": n,
    "op": op, "body": {...}}``, ``op`` one of ``execute``, ``release``, ``tools``, ``metrics``
    (the HTTP routes of the same name, through the same handlers: concurrency cap, metrics),
    answered ``{"id": n, "result": ...}`` or ``{"id": n, "error": "..."}``. A frame that breaks
    the protocol is answered ``{"error": ...}`` and closes the connection.
    """

    def __init__(
        self,
        handle: Callable[[str, str, dict[str, Any]], Awaitable[Any]],
        token: str | None,
        limits: SocketLimits,
    ) -> None:
        self.handle, self.token, self.limits = handle, token, limits
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._path: str | None = None

    async def start(self, path: str) -> None:
        """Listens on ``path`` (see `private_socket_path`), as a socket of mode 0600."""
        self._path = private_socket_path(path)
        self._server = await asyncio.start_unix_server(self._connection, path=path)
        Path(path).chmod(0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._path is not None:
            Path(self._path).unlink(missing_ok=True)

    async def _read_frame(self, reader: asyncio.StreamReader, idle_s: float | None) -> Any:
        """The next frame's object; waits at most ``idle_s`` for it to begin (TimeoutError).
        Raises `ProtocolError` for a frame over the cap, late or not JSON."""
        async with asyncio.timeout(idle_s):
            head = await reader.readexactly(FRAME_HEAD.size)
        (n,) = FRAME_HEAD.unpack(head)
        if n > self.limits.max_frame_bytes:
            raise ProtocolError(
                f"frame of {n} bytes over the cap of {self.limits.max_frame_bytes} bytes "
                "(max_body_bytes)"
            )
        try:
            async with asyncio.timeout(self.limits.frame_timeout_s):
                body = await reader.readexactly(n)
        except TimeoutError:
            detail = f"frame not received within {self.limits.frame_timeout_s:g}s (body_timeout_s)"
            raise ProtocolError(detail) from None
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
            raise ProtocolError(f"frame is not JSON: {e}") from None

    def _hello(self, hello: Any) -> str | None:
        """The namespace of a connection whose first frame is ``hello``, or None when its token
        is wrong; raises `ProtocolError` for a malformed namespace."""
        hello = hello if isinstance(hello, dict) else {}
        sent, namespace = hello.get("token"), hello.get("namespace")
        if not token_matches(sent if isinstance(sent, str) else None, self.token):
            return None
        if not (namespace is None or isinstance(namespace, str)):
            raise ProtocolError("a namespace is a string")
        try:
            return checked_namespace(namespace)
        except RequestRefusedError as e:
            raise ProtocolError(str(e)) from None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= self.limits.max_connections:
            writer.write(frame({"error": "too many connections (max_connections)"}))
            writer.close()
            return
        self._writers.add(writer)
        in_flight: set[asyncio.Task[None]] = set()
        try:
            namespace = self._hello(await self._read_frame(reader, self.limits.frame_timeout_s))
            if namespace is None:
                writer.write(frame({"error": "missing or wrong bearer token"}))
                return
            writer.write(frame({"ok": True}))
            gate = asyncio.Semaphore(self.limits.max_in_flight)
            while True:
                await gate.acquire()
                try:
                    request = await self._read_frame(reader, self.limits.idle_s)
                except TimeoutError:
                    gate.release()
                    if in_flight:
                        continue
                    return  # idle: the client reconnects when it next calls
                if not (
                    isinstance(request, dict)
                    and isinstance(request.get("id"), int)
                    and isinstance(request.get("op"), str)
                    and isinstance(request.get("body", {}), dict)
                ):
                    raise ProtocolError('a request is {"id": int, "op": str, "body": {...}}')
                task = asyncio.create_task(self._answer(namespace, request, writer, gate))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        except ProtocolError as e:
            writer.write(frame({"error": str(e)}))
        except asyncio.IncompleteReadError:  # the client sent all it will: answer what runs
            await asyncio.gather(*in_flight, return_exceptions=True)
        except (ConnectionError, TimeoutError):
            pass  # the client went away (or never said hello in time)
        finally:
            # calls still running end as on HTTP, where a client going away stops nothing;
            # their answers are dropped with the connection. The connection keeps its place
            # in max_connections until those calls have ended and it is gone (what it was
            # sent flushed, or the client gone): else a client that queues calls and breaks
            # the protocol or drops the connection, or that stops reading its answers, could
            # do so again and again, each time leaving calls queued, answers buffered and a
            # socket open past every bound (as uvicorn counts a request's task until it ends)
            writer.close()
            try:
                await asyncio.gather(*in_flight, return_exceptions=True)
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            finally:
                self._writers.discard(writer)

    async def _answer(
        self,
        namespace: str,
        request: dict[str, Any],
        writer: asyncio.StreamWriter,
        gate: asyncio.Semaphore,
    ) -> None:
        """Runs one request and writes its answer; the request holds its place in ``gate``
        until the answer is handed to the kernel, so a client that stops reading stops
        being read from."""
        rid = request["id"]
        try:
            body = request.get("body", {})
            reply = {"id": rid, "result": await self.handle(namespace, request["op"], body)}
        except Exception as e:  # what HTTP answers 422 or 500: this request fails, not the rest
            reply = {"id": rid, "error": f"{type(e).__name__}: {e}"}
        try:
            if not writer.is_closing():
                writer.write(frame(reply))
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
        finally:
            gate.release()


class ProtocolError(Exception):
    """A frame that breaks the Unix-socket protocol (see `SocketServer`)."""


@contextlib.asynccontextmanager
async def _running(
    tools: LocalTools,
    sweep_every_s: float,
    sleep: Callable[[float], Awaitable[object]],
    unix: SocketServer,
    socket_path: str | None,
) -> AsyncIterator[None]:
    """The app's lifespan: `sweep_idle` runs, and ``unix`` serves ``socket_path`` if given;
    when the app stops, both stop and the tools are closed."""
    sweeper = asyncio.create_task(sweep_idle(tools, sweep_every_s, sleep))
    try:
        if socket_path is not None:
            await unix.start(socket_path)
        yield
    finally:
        await unix.stop()
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await tools.close()


def create_app(
    registry: ToolRegistry,
    *,
    max_concurrency: int = 64,
    timeout_s: float = 30.0,
    token: str | None = None,
    idle_timeout_s: float = 600.0,
    max_trajectories: int = 10_000,
    max_body_bytes: int = 8 * 2**20,
    body_timeout_s: float = 10.0,
    caps: RequestCaps = RequestCaps(),
    action_parser: str = "hermes",
    socket_path: str | None = None,
    max_connections: int = 512,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> FastAPI:
    """The tool server's app. ``idle_timeout_s``, ``max_trajectories`` and ``clock`` go to
    `LocalTools`; while the app runs (its lifespan), `sweep_idle` expires idle trajectories
    every ``idle_timeout_s / 2`` seconds, waiting with ``sleep``, so idle state lives at most
    1.5 x ``idle_timeout_s``; when it stops, the tools are closed. ``max_body_bytes`` and
    ``body_timeout_s`` go to `BodyLimit`; ``caps`` bound what one request carries
    (`RequestCaps`). ``action_parser`` (a name of `jax_agent_rl.tokenization.tool_calls`) reads the
    actions of ``/get_observation`` (`_verl_tool_routes`).
    With ``socket_path``, the app's lifespan also serves the calls on that Unix socket
    (`SocketServer`, under the same token, with the same bounds per frame, ``max_concurrency``
    calls in flight per connection and at most ``max_connections`` connections). An empty
    ``token`` is refused: the two transports would read it differently, and an unset
    ``--token "$VAR"`` should not quietly mean no token.
    """
    if token == "":
        raise ValueError("the tool server's token is empty: give a token, or none at all")
    parser = make_parser(action_parser)
    tools = LocalTools(
        registry,
        timeout_s=timeout_s,
        idle_timeout_s=idle_timeout_s,
        max_trajectories=max_trajectories,
        clock=clock,
    )
    metrics = ServerMetrics()
    slots = asyncio.Semaphore(max_concurrency)

    unix: SocketServer  # made below, over the routes' handlers
    app = FastAPI(
        title="jax_agent_rl tool server",
        lifespan=lambda _: _running(tools, idle_timeout_s / 2, sleep, unix, socket_path),
        docs_url=None,  # nothing but /health answers without the token
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    authorize = _gate(app, token)

    @app.get("/tools", dependencies=[Depends(authorize)])
    async def schemas() -> list[dict[str, Any]]:
        return registry.schemas()

    async def run(namespace: str, req: ExecuteRequest) -> dict[str, Any]:
        """One call in ``namespace`` (the id already checked against ``caps``)."""
        return await _counted_call(
            tools, slots, metrics, state_key(namespace, req.trajectory_id), req
        )

    async def free(namespace: str, trajectory_id: str) -> dict[str, Any]:
        """Releases ``trajectory_id`` of ``namespace`` (the id already checked)."""
        await tools.release(state_key(namespace, trajectory_id))
        metrics.releases += 1
        return {"released": trajectory_id}

    @app.post("/execute", dependencies=[Depends(authorize)])
    async def execute(req: ExecuteRequest, namespace: RequestNamespace) -> dict[str, Any]:
        caps.check_id(req.trajectory_id)
        return await run(namespace, req)

    @app.post("/execute_batch", dependencies=[Depends(authorize)])
    async def execute_batch(req: BatchRequest, namespace: RequestNamespace) -> StreamingResponse:
        """Several calls in one request, run concurrently; each result is streamed as one JSON
        line ``{"index": i, "result": {...}}`` the moment it is ready, so a slow call never
        holds back the others. The whole request is checked against ``caps`` first."""
        caps.check_batch(len(req.calls), "calls")
        for call in req.calls:
            caps.check_id(call.trajectory_id)

        async def indexed(i: int, call: ExecuteRequest) -> tuple[int, dict[str, Any]]:
            return i, await run(namespace, call)

        async def lines() -> AsyncIterator[str]:
            tasks = [asyncio.ensure_future(indexed(i, c)) for i, c in enumerate(req.calls)]
            for done in asyncio.as_completed(tasks):
                i, result = await done
                yield json.dumps({"index": i, "result": result}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/release", dependencies=[Depends(authorize)])
    async def release(req: ReleaseRequest, namespace: RequestNamespace) -> dict[str, Any]:
        caps.check_id(req.trajectory_id)
        return await free(namespace, req.trajectory_id)

    _verl_tool_routes(app, parser, caps, run, free, authorize)

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def get_metrics() -> dict[str, Any]:
        return {
            **dataclasses.asdict(metrics),
            "open_trajectories": tools.open_trajectories,
            "expired": tools.expired,
        }

    async def socket_op(namespace: str, op: str, body: dict[str, Any]) -> Any:
        """A request of the Unix socket (in its connection's namespace), through the HTTP
        route of the same name."""
        if op == "execute":
            return await execute(ExecuteRequest.model_validate(body), namespace)
        if op == "release":
            return await release(ReleaseRequest.model_validate(body), namespace)
        if op == "tools":
            return await schemas()
        if op == "metrics":
            return await get_metrics()
        raise ValueError(f"unknown op {op!r}: use one of execute, release, tools, metrics")

    limits = SocketLimits(
        max_body_bytes, body_timeout_s, max_concurrency, max_connections, KEEP_ALIVE_S
    )
    unix = SocketServer(socket_op, token, limits)
    return app


async def _counted_call(
    tools: LocalTools,
    slots: asyncio.Semaphore,
    metrics: ServerMetrics,
    key: str,
    req: ExecuteRequest,
) -> dict[str, Any]:
    """``req``'s call on the state of ``key``, run within the concurrency cap ``slots`` and
    counted in ``metrics``."""
    async with slots:
        metrics.in_flight += 1
        t0 = time.perf_counter()
        try:
            result = await tools.call(key, req.name, req.arguments, req.create_kwargs)
        finally:
            metrics.in_flight -= 1
            metrics.calls += 1
            metrics.call_seconds += time.perf_counter() - t0
    metrics.errors += result.error
    return dataclasses.asdict(result)


def _gate(app: FastAPI, token: str | None) -> Callable[..., Awaitable[None]]:
    """What guards ``app``'s routes: ``GET /health``, the one route open without the token,
    which says ok and nothing else; a `RequestRefusedError` (a cap, a malformed namespace)
    answered 422; and the dependency it returns, ``authorize``: the bearer token, checked
    with `token_matches`."""

    @app.exception_handler(RequestRefusedError)
    async def refused(_: Any, e: RequestRefusedError) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=422)

    async def authorize(authorization: str | None = Header(default=None)) -> None:
        scheme, _, sent = (authorization or "").partition(" ")
        if not token_matches(sent if scheme == "Bearer" else None, token):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return authorize


def _verl_tool_routes(
    app: FastAPI,
    parser: ToolCallParser,
    caps: RequestCaps,
    run: Callable[[str, ExecuteRequest], Awaitable[dict[str, Any]]],
    free: Callable[[str, str], Awaitable[dict[str, Any]]],
    authorize: Callable[..., Awaitable[None]],
) -> None:
    """Adds verl-tool's protocol to ``app``, over the calls and releases of its ``/execute``
    and ``/release`` routes (``run`` and ``free``, in the request's namespace).

    ``POST /get_observation`` serves verl-tool's client (``verl_tool/agent_loop``): for each
    trajectory, ``finish`` releases its state and answers an empty observation; otherwise the
    action is parsed into tool calls, which run like ``/execute`` calls (concurrently, with
    the create kwargs of ``extra_fields[i]["tools_kwargs"]``), and the observation is
    ``{"obs": text, "reward": sum of the calls' rewards}``; ``is_last_step`` releases the state
    afterwards. ``dones`` is whether a tool ended the trajectory (or it finished); ``valids``
    whether the action held calls and none was malformed (``invalid_reason`` says why not).
    An action of more than ``caps.max_action_calls`` calls runs none of them: its observation
    is an error naming the cap, and it is invalid. A request of more than
    ``caps.max_batch_calls`` trajectories, or with an id over ``caps.max_id_bytes``, is refused.
    verl-tool instead routes each action to the first of its tools whose own
    ``parse_action`` accepts it; here the one parser reads them all. verl-tool's client sends
    no bearer token and no namespace: give the server no token (loopback) or put a proxy that
    adds both headers in front; without a namespace its trajectories are in the unnamed one.
    """

    async def run_call(
        namespace: str, trajectory_id: str, call: ParsedCall, create_kwargs: dict[str, Any]
    ) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"error: {call.error}", error=True)
        request = ExecuteRequest(
            trajectory_id=trajectory_id,
            name=call.name,
            arguments=call.arguments,
            create_kwargs=create_kwargs,
        )
        return ToolResult(**await run(namespace, request))

    async def observe(
        namespace: str,
        trajectory_id: str,
        action: str,
        last: bool,
        create_kwargs: dict[str, dict[str, Any]],
    ) -> tuple[dict[str, Any], bool, bool]:
        """One trajectory's observation, done and valid for its action (see above)."""
        calls = parser.parse(action)
        if len(calls) > caps.max_action_calls:
            why = (
                f"{len(calls)} tool calls in one action, over the cap of "
                f"{caps.max_action_calls} (max_action_calls); none ran"
            )
            if last:
                await free(namespace, trajectory_id)
            text = observation_text(parser, [f"error: {why}"])
            return {"obs": text, "reward": None, "invalid_reason": why}, False, False
        results = await asyncio.gather(
            *(run_call(namespace, trajectory_id, c, create_kwargs.get(c.name, {})) for c in calls)
        )
        if last:
            await free(namespace, trajectory_id)
        obs: dict[str, Any] = {
            "obs": observation_text(parser, [r.text for r in results]),
            "reward": sum(r.reward for r in results) if results else None,
        }
        malformed = [c.error for c in calls if c.error is not None]
        if not calls:
            obs["invalid_reason"] = f"no tool call found by the {parser.name} parser"
        elif malformed:
            obs["invalid_reason"] = f"malformed tool call(s): {malformed}"
        return obs, any(r.done for r in results), bool(calls) and not malformed

    @app.post("/get_observation", dependencies=[Depends(authorize)])
    async def get_observation(
        req: ObservationRequest, namespace: RequestNamespace
    ) -> dict[str, Any]:
        n = len(req.trajectory_ids)
        caps.check_batch(n, "trajectories")
        for trajectory_id in req.trajectory_ids:
            caps.check_id(trajectory_id)
        finish = req.finish or [False] * n
        last = req.is_last_step or [False] * n
        try:
            create_kwargs = [create_kwargs_by_tool(f) for f in req.extra_fields or [{}] * n]
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from e

        async def one(i: int) -> tuple[dict[str, Any], bool, bool]:
            if finish[i]:
                await free(namespace, req.trajectory_ids[i])
                return {"obs": "", "reward": None}, True, True
            trajectory_id, action = req.trajectory_ids[i], req.actions[i]
            return await observe(namespace, trajectory_id, action, last[i], create_kwargs[i])

        out = await asyncio.gather(*(one(i) for i in range(n)))
        return {
            "observations": [o for o, _, _ in out],
            "dones": [d for _, d, _ in out],
            "valids": [v for _, _, v in out],
        }


# Idle keep-alive connections close after this. It is longer than httpx's 5 s keep-alive
# expiry, so a client (`HttpTools`) always drops a pooled connection before the server does
# and never sends a call on a connection the server is closing.
KEEP_ALIVE_S = 15


def serve(
    registry: ToolRegistry,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    max_concurrency: int = 64,
    timeout_s: float = 30.0,
    *,
    idle_timeout_s: float = 600.0,
    max_trajectories: int = 10_000,
    max_body_bytes: int = 8 * 2**20,
    body_timeout_s: float = 10.0,
    caps: RequestCaps = RequestCaps(),
    max_connections: int = 512,
    action_parser: str = "hermes",
    socket_path: str | None = None,
) -> None:
    """Runs the server until interrupted; the settings are `create_app`'s. With
    ``socket_path``, the calls are served on that Unix socket too (`SocketServer`).

    Once ``max_connections`` connections are open (idle keep-alive ones included, the one
    asking too) or requests in progress, uvicorn answers a new request 503. Request bodies
    held in memory are thus at most ``max_connections x max_body_bytes``.

    What this cannot bound: uvicorn has no timeout for a request's headers, nor for a
    connection that never sends a first request, so a client that opens connections and
    sends their headers a byte at a time holds each until it gives up; enough of them fill
    ``max_connections`` and the server answers 503 to everyone. Off loopback, put a proxy
    with a header timeout (nginx ``client_header_timeout``) in front.
    """
    import uvicorn

    app = create_app(  # (refuses an empty token; nothing listens yet)
        registry,
        max_concurrency=max_concurrency,
        timeout_s=timeout_s,
        token=token,
        idle_timeout_s=idle_timeout_s,
        max_trajectories=max_trajectories,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        caps=caps,
        action_parser=action_parser,
        socket_path=socket_path,
        max_connections=max_connections,
    )
    if not is_loopback(host) and not token:
        raise ValueError(f"refusing to listen on non-loopback address {host} without --token")
    if socket_path is not None:
        private_socket_path(socket_path)  # refused here, before anything listens
    uvicorn.Server(server_config(app, host, port, max_connections)).run()


def server_config(app: ASGIApp, host: str, port: int, max_connections: int = 512) -> uvicorn.Config:
    """How `serve` (and a tool server in a Ray actor) runs ``app`` under uvicorn."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        loop="uvloop",
        http="httptools",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        limit_concurrency=max_connections,
    )


# A client does not reuse a Unix-socket connection idle this long: the server closes idle ones
# after KEEP_ALIVE_S, so a request never goes out on a connection the server is closing.
CLIENT_IDLE_S = 5.0


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The server's next frame; raises ValueError for one that is not a JSON object (what
    the connection's users catch as a broken server, so no other error reaches a caller)."""
    (n,) = FRAME_HEAD.unpack(await reader.readexactly(FRAME_HEAD.size))
    try:
        obj = json.loads(await reader.readexactly(n))
    except RecursionError as e:  # nested too deep to parse: garbage like any other
        raise ValueError(f"frame is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"frame is not a JSON object: {type(obj).__name__}")
    return obj


class _SocketConnection:
    """One connection to a `SocketServer`: requests go out as frames, and a reader task hands
    each answer to the request with its id; when the connection ends, the requests still
    waiting fail (they may have run)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ids = itertools.count()
        self.last_used = time.monotonic()
        self._reading = asyncio.create_task(self._read(reader))

    @property
    def reusable(self) -> bool:
        fresh = time.monotonic() - self.last_used < CLIENT_IDLE_S
        return not self.writer.is_closing() and (bool(self.waiting) or fresh)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the connection closed"
        try:
            while True:
                answer = await _read_frame(reader)
                rid = answer.get("id")  # an id that is not ours (not even an int) is no answer
                future = self.waiting.pop(rid, None) if isinstance(rid, int) else None
                if future is None:  # the server ends the connection with an unaddressed error
                    why = f"the server closed the connection: {answer.get('error')}"
                    break
                if not future.done():
                    future.set_result(answer)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            why = f"the connection failed: {e!r}"
        finally:
            self.writer.close()
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(ToolTransportError(why))
            self.waiting.clear()

    async def close(self) -> None:
        self.writer.close()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading


class HttpTools:
    """A `ToolExecutor` that calls a tool server over HTTP, or over its Unix socket when
    ``url`` is ``unix:PATH`` (see `SocketServer`): there every call is one frame on a shared
    connection, with no HTTP request per call, which makes calls cheap. On both, only failures
    where the request cannot have reached the server are retried.

    Each client's calls are in a namespace of their own, random, made with the client (sent
    as the ``X-Tool-Namespace`` header, or in the socket's hello): its trajectories' state is
    out of reach of every other client, whatever trajectory ids they use."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_batch: int = 32,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self.max_batch = max_batch
        self._pending: list[tuple[dict[str, Any], asyncio.Future[ToolResult]]] = []
        self._namespace = secrets.token_urlsafe(16)
        headers = {NAMESPACE_HEADER: self._namespace}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._headers, self._timeout = headers, timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        path = self.url.removeprefix("unix:") if self.url.startswith("unix:") else None
        self._socket = path[2:] if path is not None and path.startswith("//") else path
        self._token = token
        self._connections: dict[asyncio.AbstractEventLoop, _SocketConnection] = {}
        self._connecting: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    async def _connection(self, path: str) -> _SocketConnection:
        """The running loop's connection to the socket, (re)opened when needed; retries the
        connection (the request cannot have reached the server) with exponential backoff."""
        loop = asyncio.get_running_loop()
        async with self._connecting.setdefault(loop, asyncio.Lock()):
            conn = self._connections.get(loop)
            if conn is not None and conn.reusable:
                return conn
            if conn is not None:
                await conn.close()
            for attempt in range(self.retries + 1):
                try:
                    reader, writer = await asyncio.open_unix_connection(path)
                    break
                except OSError as e:
                    if attempt == self.retries:
                        raise ToolTransportError(f"tool server {self.url} unreachable: {e}") from e
                    await asyncio.sleep(self.backoff_s * 2**attempt)
            try:
                writer.write(frame({"token": self._token, "namespace": self._namespace}))
                async with asyncio.timeout(self._timeout):
                    hello = await _read_frame(reader)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
                writer.close()
                raise ToolTransportError(f"tool server {self.url} failed at hello: {e!r}") from e
            if not hello.get("ok"):
                writer.close()
                raise ToolTransportError(f"tool server {self.url} refused: {hello.get('error')}")
            self._connections[loop] = conn = _SocketConnection(reader, writer)
            return conn

    async def _socket_request(self, path: str, op: str, body: dict[str, Any]) -> Any:
        conn = await self._connection(path)
        rid = next(conn.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.waiting[rid] = future
        try:
            conn.writer.write(frame({"id": rid, "op": op, "body": body}))
            async with asyncio.timeout(self._timeout):
                await conn.writer.drain()
                answer = await future
        except TimeoutError as e:
            raise ToolTransportError(f"tool server {self.url} {op}: no answer in time") from e
        except (ConnectionError, ToolTransportError) as e:  # may have run: do not retry
            raise ToolTransportError(f"tool server {self.url} failed mid-call: {e}") from e
        finally:
            conn.waiting.pop(rid, None)
            conn.last_used = time.monotonic()
        if "error" in answer:
            raise ToolTransportError(f"tool server {self.url} {op}: {answer['error']}")
        if "result" not in answer:
            raise ToolTransportError(f"tool server {self.url} {op}: an answer without a result")
        return answer["result"]

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients[loop] = httpx.AsyncClient(headers=self._headers, timeout=self._timeout)
        return self._clients[loop]

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        if self._socket is not None:
            return await self._socket_request(self._socket, path.strip("/"), body or {})
        for attempt in range(self.retries + 1):
            try:
                response = await self._client().request(method, self.url + path, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached the server
                if attempt == self.retries:
                    raise ToolTransportError(f"tool server {self.url} unreachable: {e}") from e
                await asyncio.sleep(self.backoff_s * 2**attempt)
                continue
            except httpx.TransportError as e:  # may have run: do not retry
                raise ToolTransportError(f"tool server {self.url} failed mid-call: {e!r}") from e
            if response.status_code != 200:
                raise ToolTransportError(
                    f"tool server {self.url}{path} answered {response.status_code}: "
                    f"{response.text[:200]}"
                )
            return response.json()
        raise AssertionError("unreachable")

    async def schemas(self) -> list[dict[str, Any]]:
        return list(await self._request("GET", "/tools"))

    async def call(
        self,
        trajectory_id: str,
        name: str,
        arguments: Any,
        create_kwargs: Mapping[str, Any] | None = None,
    ) -> ToolResult:
        """One call. Calls made in the same event-loop tick travel in one HTTP request (up to
        ``max_batch``): concurrent trajectories share the per-request cost."""
        body = {
            "trajectory_id": trajectory_id,
            "name": name,
            "arguments": arguments,
            "create_kwargs": dict(create_kwargs or {}),
        }
        if self._socket is not None:  # a frame per call costs little: no batching
            result = await self._socket_request(self._socket, "execute", body)
            try:
                return ToolResult(**result)
            except TypeError as e:  # not a result: the server is broken, as for a bad frame
                raise ToolTransportError(f"tool server {self.url} execute: {e}") from e
        future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        self._pending.append((body, future))
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        if len(self._pending) >= self.max_batch:
            self._flush()
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            asyncio.get_running_loop().create_task(self._send_batch(batch))

    async def _send_batch(
        self, batch: list[tuple[dict[str, Any], asyncio.Future[ToolResult]]]
    ) -> None:
        try:
            if len(batch) == 1:
                reply = await self._request("POST", "/execute", batch[0][0])
                if not batch[0][1].done():
                    batch[0][1].set_result(ToolResult(**reply))
                return
            await self._stream_batch(batch)
        except ToolTransportError as e:
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)

    async def _stream_batch(
        self, batch: list[tuple[dict[str, Any], asyncio.Future[ToolResult]]]
    ) -> None:
        body = {"calls": [b for b, _ in batch]}
        for attempt in range(self.retries + 1):
            try:
                async with self._client().stream(
                    "POST", self.url + "/execute_batch", json=body
                ) as response:
                    if response.status_code != 200:
                        text = (await response.aread()).decode()[:200]
                        raise ToolTransportError(
                            f"tool server {self.url}/execute_batch answered "
                            f"{response.status_code}: {text}"
                        )
                    async for line in response.aiter_lines():
                        if line:
                            item = json.loads(line)
                            future = batch[item["index"]][1]
                            if not future.done():
                                future.set_result(ToolResult(**item["result"]))
                return
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if attempt == self.retries:
                    raise ToolTransportError(f"tool server {self.url} unreachable: {e}") from e
                await asyncio.sleep(self.backoff_s * 2**attempt)
            except httpx.TransportError as e:
                raise ToolTransportError(f"tool server {self.url} failed mid-call: {e!r}") from e

    async def release(self, trajectory_id: str) -> None:
        with contextlib.suppress(ToolTransportError):  # a dead server holds no state
            await self._request("POST", "/release", {"trajectory_id": trajectory_id})

    async def metrics(self) -> dict[str, Any]:
        return dict(await self._request("GET", "/metrics"))

    async def close(self) -> None:
        """Closes the HTTP client of the running event loop. Clients made in event loops that
        have ended are dropped: their connections cannot be closed from another loop."""
        clients, self._clients = self._clients, {}
        client = clients.get(asyncio.get_running_loop())
        if client is not None:
            await client.aclose()
        connections, self._connections = self._connections, {}
        connection = connections.get(asyncio.get_running_loop())
        if connection is not None:
            await connection.close()
