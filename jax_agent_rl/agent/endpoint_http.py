"""The HTTP/1.1 server under the OpenAI-compatible endpoint (`serve_http`), on asyncio streams
and h11, so that everything a client can hold is bounded (`Limits`) and shutting it down
takes a bounded time:

- Connections: at most ``max_connections``. One more closes the oldest connection that is
  waiting for a request's headers (a fresh one or an idle keep-alive one; clients reconnect),
  or, when every connection is in a request, is closed itself. File descriptors held by one
  server are thus at most ``max_connections``.
- Headers: at most ``MAX_HEADER_BYTES``, received within ``header_timeout_s`` of the
  connection opening or of its previous response; else the connection is closed unanswered.
- The handler sees the request's headers before its body is read: it may answer without
  reading it (a request naming no session: 401), and the connection is then closed, since
  the unread rest cannot be skipped safely.
- Bodies (`Request.body`): over ``max_body_bytes`` (by Content-Length, or as received) is
  `BodyError` 413; not received whole within ``body_timeout_s``, `BodyError` 408. A response
  not taken by the client within ``body_timeout_s`` closes the connection.
- Shutdown (leaving `serve_http`): the listener and idle connections close at once; requests
  in progress get ``shutdown_grace_s`` to finish, then their connections are closed and their
  handlers cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h11

MAX_HEADER_BYTES = 16 * 2**10  # a request line and headers past this close the connection
_READ_BYTES = 2**16


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one endpoint server lets its clients hold (see the module docstring)."""

    max_connections: int = 16
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 4 * 2**20
    shutdown_grace_s: float = 5.0


class BodyError(Exception):
    """A request body the server would not take: ``status`` (413, 408 or 400) says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


Response = tuple[int, dict[str, Any]]  # status and JSON body


class Request:
    """One request on a connection: its method, target and headers (names lower-cased), and
    `body`, which reads the body under the server's limits."""

    def __init__(self, event: h11.Request, connection: _Connection) -> None:
        self.method = event.method.decode("latin-1")
        self.target = event.target.decode("latin-1")
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
        self._connection = connection

    async def body(self) -> bytes:
        """The whole body; raises `BodyError` (413: too large, 408: too slow, 400: cut off)."""
        limits = self._connection.limits
        too_large = BodyError(413, f"the request body is over {limits.max_body_bytes} bytes")
        declared = self.headers.get("content-length")
        if declared is not None and int(declared) > limits.max_body_bytes:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                while not isinstance(
                    event := await self._connection.next_event(), h11.EndOfMessage
                ):
                    if not isinstance(event, h11.Data):
                        raise h11.RemoteProtocolError("no body")
                    body += event.data
                    if len(body) > limits.max_body_bytes:
                        raise too_large
        except TimeoutError:
            timeout = limits.body_timeout_s
            raise BodyError(408, f"the request body was not received within {timeout:g}s") from None
        except h11.RemoteProtocolError:
            raise BodyError(400, "the connection closed before the request body ended") from None
        return bytes(body)


Handler = Callable[[Request], Awaitable[Response]]


class _Connection:
    """One client connection: its requests in turn, each answered by the handler."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limits: Limits
    ) -> None:
        self.reader, self.writer, self.limits = reader, writer, limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.idle = True  # waiting for a request's headers
        self.task: asyncio.Task[None] | None = None

    async def next_event(self) -> Any:
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            self.h11.receive_data(await self.reader.read(_READ_BYTES))
        return event

    async def next_head(self) -> Any:
        """The next request's head (or what ends the connection), its bytes given to h11 no
        more than ``MAX_HEADER_BYTES`` in all: h11 bounds only a head that arrives in parts, so
        one that came whole in a read (17 KB, 60 KB) was parsed and served. Raises
        `h11.RemoteProtocolError` past the bound."""
        fed = len(self.h11.trailing_data[0])  # (a pipelined request's start, already read)
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            if fed >= MAX_HEADER_BYTES:
                raise h11.RemoteProtocolError("request head past MAX_HEADER_BYTES")
            data = await self.reader.read(MAX_HEADER_BYTES - fed)
            fed += len(data)
            self.h11.receive_data(data)
        return event

    async def run(self, handle: Handler) -> None:
        """Answers requests until the client closes, a limit is passed or h11 says to close."""
        while True:
            self.idle = True
            try:
                async with asyncio.timeout(self.limits.header_timeout_s):
                    event = await self.next_head()
            except (TimeoutError, h11.RemoteProtocolError):
                return
            if not isinstance(event, h11.Request):
                return  # the client closed the connection
            self.idle = False
            status, body = await handle(Request(event, self))
            await self._respond(status, body)
            if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                return  # a body left unread, or a request with "Connection: close"
            self.h11.start_next_cycle()

    async def _respond(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        if self.h11.their_state is not h11.DONE:
            headers.append(("connection", "close"))
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body)):
            self.writer.write(self.h11.send(event) or b"")
        self.writer.write(self.h11.send(h11.EndOfMessage()) or b"")
        async with asyncio.timeout(self.limits.body_timeout_s):
            await self.writer.drain()


@contextlib.asynccontextmanager
async def serve_http(handle: Handler, limits: Limits) -> AsyncIterator[int]:
    """Serves ``handle`` on a free loopback port, in this event loop, while the context is
    open; yields the port. See the module docstring for the limits and the shutdown."""
    connections: dict[_Connection, None] = {}  # oldest first
    tasks: set[asyncio.Task[Any]] = set()

    def close(connection: _Connection) -> None:
        """Ends a connection now: its socket closes and its handler is cancelled."""
        connections.pop(connection, None)
        connection.writer.transport.abort()
        if connection.task is not None:
            connection.task.cancel()

    closing = False  # once set, a connection accepted before the listener closed is dropped

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if closing:
            writer.transport.abort()
            return
        if len(connections) >= limits.max_connections:
            idle = [c for c in connections if c.idle]
            if not idle:
                writer.transport.abort()
                return
            close(idle[0])
        writer.transport.set_write_buffer_limits(0)  # drain() then waits until all is sent
        connection = _Connection(reader, writer, limits)
        connection.task = task = asyncio.current_task()
        assert task is not None
        connections[connection] = None
        tasks.add(task)
        try:
            await connection.run(handle)
        except (ConnectionError, TimeoutError, h11.ProtocolError):
            pass  # the client went away, or would not take its response: nothing to answer
        except asyncio.CancelledError:
            pass  # by `close` (evicted, or past the shutdown's grace): the task ends here
        finally:
            writer.transport.abort()  # (every response sent was drained whole)
            connections.pop(connection, None)
            tasks.discard(task)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        closing = True
        server.close()
        for connection in [c for c in connections if c.idle]:
            close(connection)
        running = set(tasks)
        if connections:
            await asyncio.wait(
                [c.task for c in connections if c.task], timeout=limits.shutdown_grace_s
            )
        for connection in list(connections):
            close(connection)
        await asyncio.gather(*running, return_exceptions=True)
