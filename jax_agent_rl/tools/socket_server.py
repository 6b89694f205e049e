"""The tool server's Unix-socket transport (`SocketServer`), which the HTTP app's lifespan
runs beside it with ``jarl serve-tools --socket PATH``.

On one machine, ``HttpTools("unix:PATH")`` calls the tools over it: each call is one frame on
a long-lived connection, answered as it ends, so a call costs ~0.2 ms of CPU on both sides
where an HTTP request costs ~1.3 ms (uvicorn + FastAPI, httpx, and the loopback TCP sends and
wake-ups).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jax_agent_rl.tools.protocol import (
    FRAME_HEAD,
    RequestRefusedError,
    checked_namespace,
    frame,
    token_matches,
)


def private_socket_path(path: str) -> str:
    """``path``, checked for serving on: its directory is this user's and closed to everyone
    else (mode 0700 or stricter), and nothing but a stale socket of ours is there already
    (which is removed). Raises ValueError otherwise."""
    where = Path(path).absolute().parent
    try:
        st = where.stat()
    except FileNotFoundError:
        raise ValueError(
            f"refusing to serve on socket {path}: its directory {where} does not exist"
        ) from None
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
    connection with no call in flight that sends nothing for ``idle_s`` is closed, and one
    whose client does not take an answer within ``frame_timeout_s`` is dropped."""

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
    `checked_namespace`; none: the unnamed one); else ``{"ok": true, "max_frame_bytes": cap}``,
    and every request of the connection is in that namespace. Then each request is ``{"id": n,
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
            # the cap, so that a client sends no frame over it: it would close the connection
            # and fail every call in flight on it
            writer.write(frame({"ok": True, "max_frame_bytes": self.limits.max_frame_bytes}))
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
                    async with asyncio.timeout(self.limits.frame_timeout_s):
                        await writer.drain()
        except TimeoutError:  # a client that takes no answer: it held its connection for good
            writer.transport.abort()
        finally:
            gate.release()


class ProtocolError(Exception):
    """A frame that breaks the Unix-socket protocol (see `SocketServer`)."""
