"""The tool server's HTTP app (`create_app`, FastAPI over a `ToolRegistry`).

Endpoints: ``GET /health`` (``{"status": "ok"}`` and nothing else: the one route open
without the token), ``GET /tools`` (schemas), ``POST /execute`` (one call; state is sticky per
trajectory; its ``create_kwargs`` reach the tool's ``create``), ``POST /execute_batch``,
``POST /release`` (free a trajectory's state), ``GET /metrics``, and the routes a wing
registers (`register_routes`: the verl wing's verl-tool ``POST /get_observation``,
`jax_agent_rl.compat.verl.tool_routes`); no docs or OpenAPI routes. Calls run
through `LocalTools` (per-call timeout, failures become error results) behind a concurrency
cap; when the app stops, every tool is closed. The token is compared in constant time on both
transports (`token_matches`).

What a careless or hostile client can hold is bounded: trajectory state expires after
``idle_timeout_s`` without a call (a sweep frees it even with no traffic) and at most
``max_trajectories`` hold state at once (see `LocalTools`); a request body is refused past
``max_body_bytes`` (413) or when not fully received within ``body_timeout_s`` (408,
`BodyLimit`); `RequestCaps` bounds what one request carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse

from jax_agent_rl.config import ToolServerSection
from jax_agent_rl.config.wings import load_wing
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import ToolCallParser, make_parser
from jax_agent_rl.tools.body_limit import BodyLimit
from jax_agent_rl.tools.protocol import (
    DEFAULT_CAPS,
    KEEP_ALIVE_S,
    BatchRequest,
    ExecuteRequest,
    ReleaseRequest,
    RequestCaps,
    RequestNamespace,
    RequestRefusedError,
    state_key,
    token_matches,
)
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.socket_server import SocketLimits, SocketServer

# more routes, each added over /execute's calls and /release's releases (its arguments: the
# app, the action parser, the caps, run, free and the token check); a wing registers them
AddRoutes = Callable[
    [
        FastAPI,
        ToolCallParser,
        RequestCaps,
        Callable[[str, ExecuteRequest], Awaitable[dict[str, Any]]],
        Callable[[str, str], Awaitable[dict[str, Any]]],
        Callable[..., Awaitable[None]],
        Tokenizer | None,
    ],
    None,
]
_ROUTES: list[AddRoutes] = []


def register_routes(add: AddRoutes) -> None:
    """Adds ``add``'s routes to every app `create_app` builds from now on (once)."""
    if add not in _ROUTES:
        _ROUTES.append(add)


@dataclasses.dataclass
class ServerMetrics:
    calls: int = 0
    errors: int = 0
    in_flight: int = 0
    releases: int = 0
    call_seconds: float = 0.0


async def sweep_idle(
    tools: LocalTools, every_s: float, sleep: Callable[[float], Awaitable[object]]
) -> None:
    """Expires idle trajectories every ``every_s`` seconds, so that their state is freed even
    when no call comes to expire it; runs until cancelled."""
    while True:
        await sleep(every_s)
        await tools.expire_idle()


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
    max_concurrency: int = ToolServerSection.max_concurrency,
    timeout_s: float = ToolServerSection.timeout_s,
    token: str | None = None,
    idle_timeout_s: float = ToolServerSection.idle_timeout_s,
    max_trajectories: int = ToolServerSection.max_trajectories,
    max_body_bytes: int = ToolServerSection.max_body_bytes,
    body_timeout_s: float = ToolServerSection.body_timeout_s,
    caps: RequestCaps = DEFAULT_CAPS,
    action_parser: str = ToolServerSection.action_parser,
    tokenizer: Tokenizer | None = None,
    socket_path: str | None = None,
    max_connections: int = ToolServerSection.max_connections,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> FastAPI:
    """The tool server's app. ``idle_timeout_s``, ``max_trajectories`` and ``clock`` go to
    `LocalTools`; while the app runs (its lifespan), `sweep_idle` expires idle trajectories
    every ``idle_timeout_s / 2`` seconds, waiting with ``sleep``, so idle state lives at most
    1.5 x ``idle_timeout_s``; when it stops, the tools are closed. ``max_body_bytes`` and
    ``body_timeout_s`` go to `BodyLimit`; ``caps`` bound what one request carries
    (`RequestCaps`). ``action_parser`` (a name of `jax_agent_rl.tokenization.tool_calls`)
    reads the actions of verl-tool's ``/get_observation`` (the verl wing's route), which
    writes the special tokens' text of ``tokenizer`` (the policy's) in its observations with a
    word joiner (`Tokenizer.defused`), and is refused without one.
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
        holds back the others. The whole request is checked against ``caps`` first; the calls
        of a client that disconnects are cancelled."""
        caps.check_batch(len(req.calls), "calls")
        for call in req.calls:
            caps.check_id(call.trajectory_id)

        async def indexed(i: int, call: ExecuteRequest) -> tuple[int, dict[str, Any]]:
            return i, await run(namespace, call)

        async def lines() -> AsyncIterator[str]:
            tasks = [asyncio.ensure_future(indexed(i, c)) for i, c in enumerate(req.calls)]
            try:
                for done in asyncio.as_completed(tasks):
                    i, result = await done
                    yield json.dumps({"index": i, "result": result}) + "\n"
            finally:  # the client went away: its calls stop (they held the server's slots)
                for task in tasks:
                    task.cancel()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/release", dependencies=[Depends(authorize)])
    async def release(req: ReleaseRequest, namespace: RequestNamespace) -> dict[str, Any]:
        caps.check_id(req.trajectory_id)
        return await free(namespace, req.trajectory_id)

    load_wing("verl")  # verl-tool's route
    for add in _ROUTES:
        add(app, parser, caps, run, free, authorize, tokenizer)

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
