"""`BodyLimit`: the tool server's ASGI middleware that bounds requests: their headers, in number
and size, and their bodies, in size and in the time they take to arrive (what uvicorn does not
bound); and `until_disconnected`, which stops a route's work when its client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A request's headers: FastAPI reads each header its routes declare by scanning them all, once
# per header, so 16,000 headers (128 KB) cost 27 s of the one event loop every call shares
# (the server's own clients send fewer than ten, under 1 KB)
MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 * 2**10
# headers that say who asks and for whom: one of each
ONE_EACH = (b"authorization", b"x-tool-namespace")
# what uvicorn's h11 parser buffers of a head (or a body's chunk header, or its trailers) not yet
# complete (`server_config`): past it the connection gets 400 and is closed
MAX_HEAD_BYTES = 64 * 2**10


class BodyTooLargeError(Exception):
    """A request body over the cap."""


class BodyLimit:
    """ASGI middleware that receives each request body whole before the app sees it: a body
    over ``max_bytes`` is answered 413 (at once when its Content-Length says so, else once the
    chunks received pass the cap), and a body not received within ``timeout_s`` (a client
    sending it a byte at a time) is answered 408. Both answers close the connection, since the
    unread rest of the body cannot be skipped safely. A client that disconnects gets nothing.
    A request of more than ``MAX_HEADERS`` headers or ``MAX_HEADER_BYTES`` of them is answered
    431 before anything else reads them, and one that gives a header of ``ONE_EACH`` twice 400.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if (
            len(headers) > MAX_HEADERS
            or sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES
        ):
            detail = f"request headers over {MAX_HEADERS} or {MAX_HEADER_BYTES} bytes"
            await _refuse(scope, receive, send, 431, detail)
            return
        names = [k.lower() for k, _ in headers]
        twice = sorted({n.decode("latin-1") for n in ONE_EACH if names.count(n) > 1})
        if twice:  # (the app read the first; a proxy in front may have checked another)
            await _refuse(scope, receive, send, 400, f"headers given more than once: {twice}")
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


T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or, if ``request``'s client disconnects first, ``work`` cancelled
    (its calls stop holding the server's slots) and a 499 that nobody reads. For a route that
    answers once (a streaming one's generator is cancelled by Starlette itself)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise HTTPException(status_code=499, detail="the client disconnected")
    finally:
        watcher.cancel()
        task.cancel()
