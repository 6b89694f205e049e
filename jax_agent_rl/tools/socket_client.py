"""The client side of the tool server's Unix socket (`jax_agent_rl.tools.socket_server`): one
connection, its frames read by a task that hands each answer to the request it addresses.
`HttpTools` (`jax_agent_rl.tools.client`) keeps a few and sends its requests through them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from typing import Any

from jax_agent_rl.tools.protocol import FRAME_HEAD
from jax_agent_rl.tools.registry import ToolTransportError

# a socket connection idle this long is not reused: the server closes it after KEEP_ALIVE_S
CLIENT_IDLE_S = 5.0


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The server's next frame; raises ValueError for one that is not a JSON object (caught
    as a broken server, so no other error reaches a caller)."""
    (n,) = FRAME_HEAD.unpack(await reader.readexactly(FRAME_HEAD.size))
    try:
        obj = json.loads(await reader.readexactly(n))
    except RecursionError as e:  # nested too deep to parse: garbage like any other
        raise ValueError(f"frame is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"frame is not a JSON object: {type(obj).__name__}")
    return obj


class SocketConnection:
    """One connection to a `SocketServer`: requests go out as frames, and a reader task hands
    each answer to the request with its id; when the connection ends, the requests still
    waiting fail (they may have run)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        max_frame_bytes: int | None = None,
    ) -> None:
        self.writer = writer
        self.max_frame_bytes = max_frame_bytes  # the server's cap (its hello says it), if any
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
                answer = await read_frame(reader)
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
