"""The tool server: `serve` runs it (``jarl serve-tools``, `jax_agent_rl.cli.serve_tools`) under
uvicorn.

It is made of the HTTP app (`jax_agent_rl.tools.app`, with verl-tool's routes in
`jax_agent_rl.compat.verl.tool_routes`), the Unix-socket transport beside it
(`jax_agent_rl.tools.socket_server`) and what both share with the client
(`jax_agent_rl.tools.protocol`); `HttpTools` (`jax_agent_rl.tools.client`) calls it. Its
settings' defaults are `ToolServerSection`'s. It refuses to listen on a non-loopback address
without a bearer token, and at most ``max_connections`` connections are served at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jax_agent_rl.config import ToolServerSection
from jax_agent_rl.tools.app import create_app
from jax_agent_rl.tools.body_limit import MAX_HEAD_BYTES
from jax_agent_rl.tools.protocol import KEEP_ALIVE_S
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.socket_server import private_socket_path

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    registry: ToolRegistry,
    host: str = ToolServerSection.host,
    port: int = ToolServerSection.port,
    *,
    token: str | None = None,
    max_connections: int = ToolServerSection.max_connections,
    socket_path: str | None = None,
    announce: Callable[[], None] | None = None,
    **settings: Any,
) -> None:
    """Runs the server until interrupted; ``settings`` are `create_app`'s other keywords
    (the one list of the server's settings). With ``socket_path``, the calls are served on
    that Unix socket too (`SocketServer`). ``announce`` runs once every setting was accepted,
    right before the server starts listening (a refused one raises `ValueError` first).

    Once ``max_connections`` connections are open (idle keep-alive ones included, the one
    asking too) or requests in progress, uvicorn answers a new request 503. Request bodies
    held in memory are thus at most ``max_connections x max_body_bytes``.

    A client that takes no answer (its reads stopped, the server's writes paused) for
    ``body_timeout_s`` loses its connection, as on the Unix socket: 7 that never read held
    every slot, and /health at 503, for as long as they stayed.

    What this cannot bound: uvicorn has no timeout for a request's headers, nor for a
    connection that never sends a first request, so a client that opens connections and
    sends their headers a byte at a time holds each until it gives up; enough of them fill
    ``max_connections`` and the server answers 503 to everyone. Off loopback, put a proxy
    with a header timeout (nginx ``client_header_timeout``) in front.
    """
    import uvicorn

    try:
        app = create_app(  # (refuses an empty token; nothing listens yet)
            registry,
            token=token,
            max_connections=max_connections,
            socket_path=socket_path,
            **settings,
        )
        if not is_loopback(host) and not token:
            raise ValueError(f"refusing to listen on non-loopback address {host} without --token")
        if socket_path is not None:
            private_socket_path(socket_path)  # refused here, before anything listens
    except ValueError:
        # the registry's tools are running (a python tool's sandbox pool) and nothing will
        # serve them: stopped here, as the app stops them when it ends
        asyncio.run(LocalTools(registry).close())
        raise
    if announce is not None:
        announce()
    write_timeout_s = settings.get("body_timeout_s", ToolServerSection.body_timeout_s)
    uvicorn.Server(server_config(app, host, port, max_connections, write_timeout_s)).run()


def server_config(
    app: ASGIApp,
    host: str,
    port: int,
    max_connections: int = ToolServerSection.max_connections,
    write_timeout_s: float = ToolServerSection.body_timeout_s,
) -> uvicorn.Config:
    """How `serve` (and a tool server in a Ray actor) runs ``app`` under uvicorn: a
    connection whose client leaves the server's writes paused ``write_timeout_s`` is
    dropped (`_write_timeout`)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        loop="uvloop",
        # h11, bounded at MAX_HEAD_BYTES (`_write_timeout`), bounds a request's head as it
        # arrives (a 64 MB header sent in pieces cost httptools 8 s of the one event loop,
        # quadratic in its pieces) and keeps a chunked body's trailers out of the headers
        # (httptools appended 16,000 of them after `BodyLimit` had counted: 10 s of
        # FastAPI's scans)
        http=_write_timeout(write_timeout_s),
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        limit_concurrency=max_connections,
    )


def _write_timeout(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, whose connection is dropped (aborted) once its writes have
    stayed paused for ``seconds``: the client reads nothing (its buffers and ours are full).
    uvicorn has no write timeout: the response's writer waited on such a client for good,
    holding a connection and a task of ``limit_concurrency``. The writer left waiting is
    woken once the connection is lost, and finds the client gone.

    Its 400 says what h11 found wrong ("illegal chunk header: ..."), where uvicorn's said
    "Invalid HTTP request received." to a malformed chunked body or head alike."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class SaysWhy(h11.Connection):
        """h11's server side, keeping why it refused the request it was reading."""

        why = ""

        def next_event(self) -> Any:
            try:
                return super().next_event()
            except h11.RemoteProtocolError as e:
                self.why = str(e)[:200]
                raise

    class WriteTimeoutH11(H11Protocol):
        _stalled: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = SaysWhy(h11.SERVER, MAX_HEAD_BYTES)  # a head's bound, as it arrives

        def send_400_response(self, msg: str) -> None:
            why = getattr(self.conn, "why", "")
            super().send_400_response(f"{msg.rstrip('.')}: {why}" if why else msg)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stalled is None:
                self._stalled = self.loop.call_later(seconds, self.transport.abort)

        def resume_writing(self) -> None:
            self._unstall()
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            self._unstall()
            super().connection_lost(exc)
            self.flow.resume_writing()  # a writer waiting on the client wakes to its absence

        def _unstall(self) -> None:
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

    return WriteTimeoutH11
