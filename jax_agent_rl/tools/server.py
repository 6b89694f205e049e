"""The tool server (FastAPI over a `ToolRegistry`) and its client, `HttpTools`.

Endpoints: ``GET /health``, ``GET /tools`` (schemas), ``POST /execute`` (one call; state is
sticky per ``trajectory_id``; its ``create_kwargs`` reach the tool's ``create``), ``POST
/release`` (free a trajectory's state), ``GET /metrics``, and verl-tool's ``POST
/get_observation`` (see `create_app`). Calls run through `LocalTools` (per-call timeout, failures
become error results) behind a concurrency cap; when the app stops, every tool is closed. The
server refuses to listen on a non-loopback address without a bearer token.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, model_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jax_agent_rl.agent.parsers import (
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
    action_parser: str = "hermes",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> FastAPI:
    """The tool server's app. ``idle_timeout_s``, ``max_trajectories`` and ``clock`` go to
    `LocalTools`; while the app runs (its lifespan), `sweep_idle` expires idle trajectories
    every ``idle_timeout_s / 2`` seconds, waiting with ``sleep``, so idle state lives at most
    1.5 x ``idle_timeout_s``; when it stops, the tools are closed. ``max_body_bytes`` and
    ``body_timeout_s`` go to `BodyLimit`. ``action_parser`` (a name of
    `jax_agent_rl.agent.parsers`) reads the actions of ``/get_observation`` (`_verl_tool_routes`).
    """
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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        del app
        sweeper = asyncio.create_task(sweep_idle(tools, idle_timeout_s / 2, sleep))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await tools.close()

    app = FastAPI(title="jax_agent_rl tool server", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)

    async def authorize(authorization: str | None = Header(default=None)) -> None:
        if token is not None and authorization != f"Bearer {token}":
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "tools": registry.names}

    @app.get("/tools", dependencies=[Depends(authorize)])
    async def schemas() -> list[dict[str, Any]]:
        return registry.schemas()

    @app.post("/execute", dependencies=[Depends(authorize)])
    async def execute(req: ExecuteRequest) -> dict[str, Any]:
        async with slots:
            metrics.in_flight += 1
            t0 = time.perf_counter()
            try:
                result = await tools.call(
                    req.trajectory_id, req.name, req.arguments, req.create_kwargs
                )
            finally:
                metrics.in_flight -= 1
                metrics.calls += 1
                metrics.call_seconds += time.perf_counter() - t0
        metrics.errors += result.error
        return dataclasses.asdict(result)

    @app.post("/execute_batch", dependencies=[Depends(authorize)])
    async def execute_batch(req: BatchRequest) -> StreamingResponse:
        """Several calls in one request, run concurrently; each result is streamed as one JSON
        line ``{"index": i, "result": {...}}`` the moment it is ready, so a slow call never
        holds back the others."""

        async def indexed(i: int, call: ExecuteRequest) -> tuple[int, dict[str, Any]]:
            return i, await execute(call)

        async def lines() -> AsyncIterator[str]:
            tasks = [asyncio.ensure_future(indexed(i, c)) for i, c in enumerate(req.calls)]
            for done in asyncio.as_completed(tasks):
                i, result = await done
                yield json.dumps({"index": i, "result": result}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/release", dependencies=[Depends(authorize)])
    async def release(req: ReleaseRequest) -> dict[str, Any]:
        await tools.release(req.trajectory_id)
        metrics.releases += 1
        return {"released": req.trajectory_id}

    _verl_tool_routes(app, parser, execute, release, authorize)

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def get_metrics() -> dict[str, Any]:
        return {
            **dataclasses.asdict(metrics),
            "open_trajectories": tools.open_trajectories,
            "expired": tools.expired,
        }

    return app


def _verl_tool_routes(
    app: FastAPI,
    parser: ToolCallParser,
    execute: Callable[[ExecuteRequest], Awaitable[dict[str, Any]]],
    release: Callable[[ReleaseRequest], Awaitable[dict[str, Any]]],
    authorize: Callable[..., Awaitable[None]],
) -> None:
    """Adds verl-tool's protocol to ``app``, over its ``execute`` and ``release`` routes.

    ``POST /get_observation`` serves verl-tool's client (``verl_tool/agent_loop``): for each
    trajectory, ``finish`` releases its state and answers an empty observation; otherwise the
    action is parsed into tool calls, which run like ``/execute`` calls (concurrently, with
    the create kwargs of ``extra_fields[i]["tools_kwargs"]``), and the observation is
    ``{"obs": text, "reward": sum of the calls' rewards}``; ``is_last_step`` releases the state
    afterwards. ``dones`` is whether a tool ended the trajectory (or it finished); ``valids``
    whether the action held calls and none was malformed (``invalid_reason`` says why not).
    verl-tool instead routes each action to the first of its tools whose own
    ``parse_action`` accepts it; here the one parser reads them all. verl-tool's client sends
    no bearer token: give the server none (loopback) or put a proxy that adds it in front.
    """

    async def run_call(
        trajectory_id: str, call: ParsedCall, create_kwargs: dict[str, Any]
    ) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"error: {call.error}", error=True)
        request = ExecuteRequest(
            trajectory_id=trajectory_id,
            name=call.name,
            arguments=call.arguments,
            create_kwargs=create_kwargs,
        )
        return ToolResult(**await execute(request))

    async def observe(
        trajectory_id: str, action: str, last: bool, create_kwargs: dict[str, dict[str, Any]]
    ) -> tuple[dict[str, Any], bool, bool]:
        """One trajectory's observation, done and valid for its action (see above)."""
        calls = parser.parse(action)
        results = await asyncio.gather(
            *(run_call(trajectory_id, c, create_kwargs.get(c.name, {})) for c in calls)
        )
        if last:
            await release(ReleaseRequest(trajectory_id=trajectory_id))
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
    async def get_observation(req: ObservationRequest) -> dict[str, Any]:
        n = len(req.trajectory_ids)
        finish = req.finish or [False] * n
        last = req.is_last_step or [False] * n
        try:
            create_kwargs = [create_kwargs_by_tool(f) for f in req.extra_fields or [{}] * n]
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from e

        async def one(i: int) -> tuple[dict[str, Any], bool, bool]:
            if finish[i]:
                await release(ReleaseRequest(trajectory_id=req.trajectory_ids[i]))
                return {"obs": "", "reward": None}, True, True
            trajectory_id, action = req.trajectory_ids[i], req.actions[i]
            return await observe(trajectory_id, action, last[i], create_kwargs[i])

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
    max_connections: int = 512,
    action_parser: str = "hermes",
) -> None:
    """Runs the server until interrupted; the settings are `create_app`'s.

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

    if not is_loopback(host) and not token:
        raise ValueError(f"refusing to listen on non-loopback address {host} without --token")
    app = create_app(
        registry,
        max_concurrency=max_concurrency,
        timeout_s=timeout_s,
        token=token,
        idle_timeout_s=idle_timeout_s,
        max_trajectories=max_trajectories,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        action_parser=action_parser,
    )
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


class HttpTools:
    """A `ToolExecutor` that calls a tool server over HTTP."""

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
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._headers, self._timeout = headers, timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients[loop] = httpx.AsyncClient(headers=self._headers, timeout=self._timeout)
        return self._clients[loop]

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
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
