"""The tool server's client, `HttpTools`: a `ToolExecutor` the agent loop uses exactly like
`LocalTools`, over HTTP or over the server's Unix socket (`jax_agent_rl.tools.socket_server`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

import httpx

from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.protocol import FRAME_HEAD, NAMESPACE_HEADER, frame
from jax_agent_rl.tools.registry import ToolTransportError
from jax_agent_rl.tools.socket_client import SocketConnection, read_frame

# the most bytes of calls one /execute_batch request carries (a call longer on its own goes
# alone), well within the server's bound on a body (max_body_bytes, 8 MiB by default): a body
# over the bound is cut off as it is sent, so the client reads no 413 to split the batch on,
# only a broken connection, and ten calls of 1 MB each, each one well within the bound, all
# failed for their batch's sum (tool_error), siblings' episodes with them
BATCH_BYTES = 2**20


class _TooLargeError(ToolTransportError):
    """The server refused a request for its size (413), before running any of its calls."""


class _LateError(ToolTransportError):
    """No answer to a request within the client's timeout: the server may be alive, the
    call running past it (`HttpTools._late`)."""


def _refused(url: str, response: httpx.Response, text: str) -> ToolTransportError:
    """The error of a request ``response`` did not answer with a result (``text``: its body)."""
    error = _TooLargeError if response.status_code == 413 else ToolTransportError
    return error(f"tool server {url} answered {response.status_code}: {text[:200]}")


def _too_large(name: str, error: _TooLargeError) -> ToolResult:
    """The result of a call too large for the server on its own: the model's error."""
    return ToolResult(
        f"error: the call to {name} is over the tool server's cap on a request ({error})",
        error=True,
    )


def _late(name: str, error: _LateError) -> ToolResult:
    """The result of a call that got no answer in time from a server that answers others:
    the call ran too long, the model's error (as a call past the server's own timeout is)."""
    return ToolResult(
        f"error: the call to {name} ran past the client's timeout (tools.timeout_s) while the "
        f"tool server answers other requests ({error})",
        error=True,
    )


class HttpTools:
    """A `ToolExecutor` that calls a tool server over HTTP, or over its Unix socket when
    ``url`` is ``unix:PATH`` (see `SocketServer`): there every call is one frame on a shared
    connection, with no HTTP request per call, which makes calls cheap. Over HTTP, calls made
    in the same event-loop tick share one ``/execute_batch`` request (at most ``max_batch``
    calls, of at most `BATCH_BYTES` in all but for one longer call alone). On both, only failures
    where the request cannot have reached the server (connection refused or timed out while
    connecting) are retried, with exponential backoff; any other transport failure, or retries
    used up, raises `ToolTransportError` (the trajectory ends with stop reason ``tool_error``).
    A request the server refuses for its size (413) ran nothing: a batch's calls are sent
    again in halves, and a call too large on its own is its error result (the model's, like
    arguments that are not JSON): calls batched with long ones do not fail for them. On the
    socket, a call over the cap the server's hello gave is not sent (its frame would close the
    connection the client's other calls share), and is its error result too. A call that gets
    no answer within ``timeout_s`` is its error result too when the server then answers a
    cheap request in time (`_alive`): the call ran too long on the model's arguments, as one
    past the server's own timeout does (a policy whose calls ran past the client's timeout
    ended its episodes ``tool_error``, untrained, and escaped a wrong answer's penalty); when
    the server does not answer that either, it is down or stuck: ``tool_error``.

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
        self._pending_bytes = 0  # their bodies' (a batch's body stays within BATCH_BYTES)
        self._namespace = secrets.token_urlsafe(16)
        headers = {NAMESPACE_HEADER: self._namespace}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._headers, self._timeout = headers, timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        path = self.url.removeprefix("unix:") if self.url.startswith("unix:") else None
        self._socket = path[2:] if path is not None and path.startswith("//") else path
        self._token = token
        self._connections: dict[asyncio.AbstractEventLoop, SocketConnection] = {}
        self._connecting: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    async def _connection(self, path: str) -> SocketConnection:
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
                    hello = await read_frame(reader)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
                writer.close()
                raise ToolTransportError(f"tool server {self.url} failed at hello: {e!r}") from e
            if not hello.get("ok"):
                writer.close()
                raise ToolTransportError(f"tool server {self.url} refused: {hello.get('error')}")
            cap = hello.get("max_frame_bytes")
            cap = cap if isinstance(cap, int) else None
            self._connections[loop] = conn = SocketConnection(reader, writer, cap)
            return conn

    async def _socket_request(self, path: str, op: str, body: dict[str, Any]) -> Any:
        conn = await self._connection(path)
        rid = next(conn.ids)
        message = frame({"id": rid, "op": op, "body": body})
        over = len(message) - FRAME_HEAD.size
        if conn.max_frame_bytes is not None and over > conn.max_frame_bytes:
            # not sent: the server would close the connection, and the calls in flight on it
            raise _TooLargeError(
                f"tool server {self.url}: a frame of {over} bytes, over the cap of "
                f"{conn.max_frame_bytes} bytes"
            )
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.waiting[rid] = future
        try:
            conn.writer.write(message)
            async with asyncio.timeout(self._timeout):
                await conn.writer.drain()
                answer = await future
        except TimeoutError as e:
            raise _LateError(f"tool server {self.url} {op}: no answer in time") from e
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

    async def _alive(self, late: _LateError) -> None:
        """Returns when the server answers a cheap request in time (``/health``; on the socket,
        its tool list): then a call that got no answer in time (``late``) ran too long, and is
        the model's error (`_late`). Raises `ToolTransportError` naming both when it does not
        (the server is down or stuck): the episode's ``tool_error``."""
        try:
            if self._socket is not None:
                await self._socket_request(self._socket, "tools", {})
            else:
                await self._request("GET", "/health")
        except ToolTransportError as e:
            raise ToolTransportError(f"{late}, and then {e}") from e

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
            except httpx.ReadTimeout as e:  # sent, and not answered in time
                raise _LateError(f"tool server {self.url}{path}: no answer in time") from e
            except httpx.TransportError as e:  # may have run: do not retry
                raise ToolTransportError(f"tool server {self.url} failed mid-call: {e!r}") from e
            if response.status_code != 200:
                raise _refused(f"{self.url}{path}", response, response.text)
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
        ``max_batch``): concurrent trajectories share the per-request cost. Arguments that are
        not strict JSON (NaN, a lone surrogate, an object) are this call's error result, as
        `LocalTools` answers bad arguments: they never reach the request its batch shares."""
        body = {
            "trajectory_id": trajectory_id,
            "name": name,
            "arguments": arguments,
            "create_kwargs": dict(create_kwargs or {}),
        }
        try:  # as httpx writes a body
            size = len(json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8"))
        except (ValueError, TypeError, RecursionError) as e:  # UnicodeEncodeError included
            return ToolResult(f"error: the arguments of {name} are not JSON: {e}", error=True)
        if self._socket is not None:  # a frame per call costs little: no batching
            try:
                result = await self._socket_request(self._socket, "execute", body)
            except _TooLargeError as e:
                return _too_large(name, e)
            except _LateError as e:
                await self._alive(e)
                return _late(name, e)
            try:
                return ToolResult(**result)
            except TypeError as e:  # not a result: the server is broken, as for a bad frame
                raise ToolTransportError(f"tool server {self.url} execute: {e}") from e
        future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        if self._pending_bytes + size > BATCH_BYTES:  # (a long call goes in a batch of its own)
            self._flush()
        self._pending.append((body, future))
        self._pending_bytes += size
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        if len(self._pending) >= self.max_batch or self._pending_bytes > BATCH_BYTES:
            self._flush()
        return await future

    def _flush(self) -> None:
        batch, self._pending, self._pending_bytes = self._pending, [], 0
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
        except _TooLargeError as e:  # refused unread: nothing ran
            if len(batch) > 1:
                half = len(batch) // 2
                await asyncio.gather(self._send_batch(batch[:half]), self._send_batch(batch[half:]))
            elif not batch[0][1].done():
                batch[0][1].set_result(_too_large(batch[0][0]["name"], e))
        except _LateError as e:  # the calls still unanswered ran past the timeout
            waiting = [(body, future) for body, future in batch if not future.done()]
            try:
                await self._alive(e)
            except ToolTransportError as dead:
                for _, future in waiting:
                    future.set_exception(dead)
                return
            for body, future in waiting:
                future.set_result(_late(body["name"], e))
        except Exception as e:  # no caller of the batch may wait forever, whatever failed
            failed = (
                e
                if isinstance(e, ToolTransportError)  # else: an answer that is not a result
                else ToolTransportError(f"tool server {self.url} answered no result: {e!r}")
            )
            for _, future in batch:
                if not future.done():
                    future.set_exception(failed)

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
                        text = (await response.aread()).decode(errors="replace")
                        raise _refused(f"{self.url}/execute_batch", response, text)
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
            except httpx.ReadTimeout as e:
                raise _LateError(f"tool server {self.url}/execute_batch: no answer in time") from e
            except httpx.TransportError as e:
                raise ToolTransportError(f"tool server {self.url} failed mid-call: {e!r}") from e

    async def release(self, trajectory_id: str) -> None:
        with contextlib.suppress(ToolTransportError):  # a dead server holds no state
            await self._request("POST", "/release", {"trajectory_id": trajectory_id})

    async def metrics(self) -> dict[str, Any]:
        return dict(await self._request("GET", "/metrics"))

    def counters(self) -> dict[str, float]:
        return {}

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
