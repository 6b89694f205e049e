"""What starting a JetStream server takes (`jax_agent_rl.backends.jetstream.client`): how it
samples (`ServerSampling`), its ready line (`handshake`), and the error of a start that fails."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import IO, Any


class ServerStartError(RuntimeError):
    """A JetStream server that could not start; the message says why."""


@dataclasses.dataclass(frozen=True)
class ServerSampling:
    """How the server samples every request (the sampling section's settings)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


SERVER_DEFAULTS = ServerSampling()


def handshake(out: IO[bytes]) -> Iterator[dict[str, Any]]:
    """The server's one ready line; then its stdout is read to the end (its exit)."""
    line = out.readline()
    if line:
        yield json.loads(line)
    out.read()
