"""`Router`: which of several engines (vLLM processes, Ray replicas) serves a request.

A request with a ``session_id`` goes to the engine that served the session's last turn (its
prefix cache holds the conversation); a session's first turn goes to the engine of the
session it continues (``prefix_session``, a tree rollout's branch); anything else, or a
session whose engine is gone, goes to the live engine with the fewest requests in flight
(the lowest index among equals). The router remembers the last ``size`` sessions, least
recently used out.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from jax_agent_rl.protocol import GenerateRequest

SESSION_MEMORY = 8192  # sessions whose engine a router remembers by default


class Router(collections.OrderedDict[str, int]):
    """Session id -> engine index, the least recently used first (see the module docstring)."""

    def __init__(self, size: int = SESSION_MEMORY) -> None:
        super().__init__()
        self.size = size

    def pick(
        self, request: GenerateRequest, live: Sequence[int], load: Callable[[int], int]
    ) -> int | None:
        """The engine for ``request`` among the ``live`` indices (None: none is live);
        ``load(i)``: engine ``i``'s requests in flight."""
        for session_id in (request.session_id, request.prefix_session):
            if session_id is not None and self.get(session_id) in live:
                self.move_to_end(session_id)
                return self[session_id]
        return min(live, key=lambda i: (load(i), i), default=None)

    def remember(self, session_id: str | None, index: int) -> None:
        """Engine ``index`` served ``session_id``'s latest turn."""
        if session_id is None:
            return
        self[session_id] = index
        self.move_to_end(session_id)
        while len(self) > self.size:
            self.popitem(last=False)
