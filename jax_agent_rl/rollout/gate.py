"""`WeightGate`: how every backend keeps a weight update apart from the requests it serves.

A request enters (`WeightGate.enter`: its id is now taken) and is admitted (`admit`): at once
when no update runs, stamped with the weight version it is sampled under; while one runs, it
waits at the gate. An update (`update`) holds new requests, waits until the admitted ones are
done (`done`: drained), runs the backend's push, bumps the version, and then admits the
waiting requests before it returns, so they are counted (and drained) before a second update
can start. An abort (`abort`) marks the request: one waiting at the gate, or let through but
not yet sent, is not sent at all (the backend checks `Ticket.aborted` under the gate's lock
where it sends). `close` aborts everything and refuses what comes later.

A gate made with ``drain=False`` (an engine that keeps its KV over a push and goes on with
the new weights: ``engine.keep_kv_on_update``) neither holds nor drains: the push runs while
requests are in flight, and the backend says which weights sampled each token.

The gate is thread-safe, and any event loop may call in: a backend whose engine answers on
threads shares its lock with the gate (``lock=``), so its send and an abort are one step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from jax_agent_rl.protocol import InvalidRequestError, resolve_from_thread


@dataclasses.dataclass
class Ticket:
    """One request at the gate. ``version``: the weights it is sampled under (set when it is
    admitted); ``handle``: what its backend needs to stop it once sent (JetStream's gRPC
    call), set under the gate's lock."""

    request_id: str
    version: int = 0
    aborted: bool = False
    admitted: bool = False  # counted until `done`: an update drains it
    handle: Any = None
    _wait: tuple[asyncio.Future[bool], asyncio.AbstractEventLoop] | None = None


class WeightGate:
    """Admission, drain and version for one backend (see the module docstring)."""

    def __init__(
        self, version: int = 0, lock: threading.Lock | None = None, drain: bool = True
    ) -> None:
        self.version, self.drain = version, drain
        self.lock = lock or threading.Lock()
        self.closed = False
        self._tickets: dict[str, Ticket] = {}  # every request not done, waiting or admitted
        self._admitted = 0
        self._updating = False
        self._drained: tuple[asyncio.Future[None], asyncio.AbstractEventLoop] | None = None

    def enter(self, request_id: str) -> Ticket:
        """Takes ``request_id`` (a second request with an id in flight is refused); admits it
        at once unless an update runs. Always followed by `done`."""
        with self.lock:
            if self.closed:
                raise RuntimeError("the backend is closed")
            if request_id in self._tickets:
                raise InvalidRequestError(f"request_id {request_id!r} is already in flight")
            ticket = self._tickets[request_id] = Ticket(request_id)
            if self._updating and self.drain:  # it waits for the update's end (`update`)
                loop = asyncio.get_running_loop()
                ticket._wait = (loop.create_future(), loop)
            else:
                self._admit(ticket)
        return ticket

    async def admit(self, ticket: Ticket) -> bool:
        """Waits while an update runs; False when the request was aborted (or the backend
        closed) before it could be sent."""
        if ticket._wait is not None:
            await ticket._wait[0]
        with self.lock:
            return not ticket.aborted

    def done(self, ticket: Ticket) -> None:
        """The request is over (finished, aborted or failed): an update waiting for the
        admitted ones to finish may start once it is the last."""
        with self.lock:
            del self._tickets[ticket.request_id]
            if ticket.admitted:
                self._admitted -= 1
            drained = self._drained if self._admitted == 0 else None
        if drained is not None:
            resolve_from_thread(drained[0], drained[1], None)

    def get(self, request_id: str) -> Ticket | None:
        with self.lock:
            return self._tickets.get(request_id)

    def tickets(self) -> list[Ticket]:
        with self.lock:
            return list(self._tickets.values())

    def abort(self, request_id: str) -> Ticket | None:
        """Marks the request aborted and lets it go from the gate if it waits there; its
        ticket (None: not in flight), whose ``handle`` the backend then stops."""
        with self.lock:
            ticket = self._tickets.get(request_id)
            if ticket is None:
                return None
            ticket.aborted = True
        if ticket._wait is not None:
            resolve_from_thread(ticket._wait[0], ticket._wait[1], False)
        return ticket

    def close(self) -> list[Ticket]:
        """Aborts every request and refuses new ones and updates; the tickets it aborted."""
        with self.lock:
            self.closed = True
            tickets = list(self._tickets.values())
            for ticket in tickets:
                ticket.aborted = True
        for ticket in tickets:
            if ticket._wait is not None:
                resolve_from_thread(ticket._wait[0], ticket._wait[1], False)
        return tickets

    async def update(
        self,
        push: Callable[[], Awaitable[None]],
        version: int,
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> float:
        """Holds new requests, drains the admitted ones (neither without ``drain``) while
        ``prepare()`` runs (a backend placing the new weights beside the old: a staged push),
        awaits ``push()`` (the backend's load, or swap, of the new weights), then serves
        ``version``. A failed prepare or push keeps the old version; either way the requests
        held meanwhile go out. Returns the seconds new requests were held (0 without
        ``drain``)."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        with self.lock:
            if self.closed:
                raise RuntimeError("the backend is closed")
            if self._updating:
                raise RuntimeError("a weight update is already under way")
            self._updating = True
            if self._admitted and self.drain:
                self._drained = (loop.create_future(), loop)
        try:
            staging = None if prepare is None else asyncio.ensure_future(prepare())
            try:
                if self._drained is not None:
                    await self._drained[0]
            except BaseException:
                if staging is not None:
                    staging.cancel()
                raise
            if staging is not None:
                await staging
            if self.closed:
                raise RuntimeError("the backend is closed")
            await push()
            self.version = version
            return time.perf_counter() - t0 if self.drain else 0.0
        finally:
            with self.lock:
                self._updating, self._drained = False, None
                waiting = [t for t in self._tickets.values() if t._wait and not t.admitted]
                for ticket in waiting:  # counted before any later update can start
                    self._admit(ticket)
            for ticket in waiting:
                assert ticket._wait is not None
                resolve_from_thread(ticket._wait[0], ticket._wait[1], not ticket.aborted)

    def _admit(self, ticket: Ticket) -> None:
        """Counts ``ticket`` as going out now, under the current weights (the lock is held)."""
        ticket.version = self.version
        ticket.admitted = True
        self._admitted += 1
