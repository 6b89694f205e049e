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
    uvicorn.Server(server_config(app, host, port, max_connections)).run()


def server_config(
    app: ASGIApp, host: str, port: int, max_connections: int = ToolServerSection.max_connections
) -> uvicorn.Config:
    """How `serve` (and a tool server in a Ray actor) runs ``app`` under uvicorn."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        loop="uvloop",
        # h11 bounds a request's head as it arrives (a 64 MB header sent in pieces cost
        # httptools 8 s of the one event loop, quadratic in its pieces) and keeps a chunked
        # body's trailers out of the headers (httptools appended 16,000 of them after
        # `BodyLimit` had counted: 10 s of FastAPI's scans)
        http="h11",
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        limit_concurrency=max_connections,
    )
