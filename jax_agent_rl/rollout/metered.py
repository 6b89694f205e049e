"""`MeteredBackend`: a rollout backend, measured: how long it sat with no request in flight.

A training loop reads `MeteredBackend.idle_s` at the start and end of a step to report the
rollout engines' idle fraction (the synchronous loop leaves them idle while the learner
updates; the asynchronous one should not), and `MeteredBackend.counters` to report what the
backend counts itself (its ``counters()``, running totals such as the Ray pool's replica
deaths and re-run requests). `MeteredBackend.version` is the weight version it serves (the
newest pushed, from the start of the push): a judge that is the policy keys its scores by it.
"""

from __future__ import annotations

import time
from typing import Any

from jax_agent_rl.protocol import (
    GenerateRequest,
    GenerateResult,
    PushStats,
    RolloutBackend,
)


class MeteredBackend:
    """``inner`` behind the same protocol, counting its idle time (one event loop's calls);
    ``version``: the weight version it starts serving."""

    def __init__(self, inner: RolloutBackend, version: int = 0) -> None:
        self.inner = inner
        self.version = version
        self.capabilities = inner.capabilities
        self._in_flight = 0
        self._idle_s = 0.0
        self._idle_since: float | None = time.monotonic()

    def idle_s(self) -> float:
        """Seconds so far with no request in flight."""
        now = time.monotonic()
        return self._idle_s + (0.0 if self._idle_since is None else now - self._idle_since)

    @property
    def last_push(self) -> PushStats | None:
        """``inner``'s last weight push (None: none yet, or a backend that keeps no figures)."""
        return getattr(self.inner, "last_push", None)

    def counters(self) -> dict[str, float]:
        """The backend's own running totals by metric name (none for most backends)."""
        return dict(self.inner.counters())

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._in_flight == 0 and self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None
        self._in_flight += 1
        try:
            return await self.inner.generate(request)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle_since = time.monotonic()

    async def update_weights(self, params: Any, version: int) -> None:
        self.version = version
        await self.inner.update_weights(params, version)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def close(self) -> None:
        await self.inner.close()
