"""The tool server (FastAPI over a `ToolRegistry`) and its client, `HttpTools`.

Endpoints: ``GET /health``, ``GET /tools`` (schemas), ``POST /execute`` (one call; state is
sticky per ``trajectory_id``), ``POST /release`` (free a trajectory's state), ``GET /metrics``.
Calls run through `LocalTools` (per-call timeout, failures become error results) behind a
concurrency cap. The server refuses to listen on a non-loopback address without a bearer
token.

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
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry, ToolTransportError


class ExecuteRequest(BaseModel):
    trajectory_id: str
    name: str
    arguments: Any = None


class ReleaseRequest(BaseModel):
    trajectory_id: str


class BatchRequest(BaseModel):
    calls: list[ExecuteRequest]


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


def create_app(
    registry: ToolRegistry,
    *,
    max_concurrency: int = 64,
    timeout_s: float = 30.0,
    token: str | None = None,
) -> FastAPI:
    tools = LocalTools(registry, timeout_s=timeout_s)
    metrics = ServerMetrics()
    slots = asyncio.Semaphore(max_concurrency)
    app = FastAPI(title="jax_agent_rl tool server")

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
                result = await tools.call(req.trajectory_id, req.name, req.arguments)
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

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def get_metrics() -> dict[str, Any]:
        return {**dataclasses.asdict(metrics), "open_trajectories": tools.open_trajectories}

    return app


def serve(
    registry: ToolRegistry,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    max_concurrency: int = 64,
    timeout_s: float = 30.0,
) -> None:
    """Runs the server until interrupted."""
    import uvicorn

    if not is_loopback(host) and not token:
        raise ValueError(f"refusing to listen on non-loopback address {host} without --token")
    app = create_app(registry, max_concurrency=max_concurrency, timeout_s=timeout_s, token=token)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        loop="uvloop",
        http="httptools",
        access_log=False,
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

    async def call(self, trajectory_id: str, name: str, arguments: Any) -> ToolResult:
        """One call. Calls made in the same event-loop tick travel in one HTTP request (up to
        ``max_batch``): concurrent trajectories share the per-request cost."""
        body = {"trajectory_id": trajectory_id, "name": name, "arguments": arguments}
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

    async def aclose(self) -> None:
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
