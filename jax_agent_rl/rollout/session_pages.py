"""`SessionPages`: the embedded backend's KV pages kept between requests.

A finished request of a session leaves its pages to the session (least recently used out,
``size`` sessions at most, and evicted when the pool runs short), so the session's next turn
prefills only what follows the longest common prefix; a branch of a tree rollout starts from
the session it continues (``prefix_session``). Every full page of a known prefix is also
registered in the pool (`PagePool.lookup`), so requests sharing a prompt share its pages.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Collection

from jax_agent_rl.engine.pages import PagePool, prefix_keys
from jax_agent_rl.rollout.protocol import GenerateRequest


@dataclasses.dataclass
class BackendStats:
    """The embedded backend's running totals."""

    requests: int = 0
    prefilled_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from a session's cached prefix
    generated_tokens: int = 0
    decode_calls: int = 0
    aborted: int = 0
    preempted: int = 0  # requests whose pages were taken back to be computed again later
    page_copies: int = 0  # shared pages copied before a request wrote into them
    sessions_evicted: int = 0  # kept sessions dropped because the pool ran short
    peak_pages_in_use: int = 0


class SessionPages:
    """Session id -> (the tokens its pages hold, the pages), each page held by the session,
    over ``pool``; `take` evicts sessions for room (counted in ``stats``)."""

    def __init__(self, pool: PagePool, page_size: int, size: int, stats: BackendStats) -> None:
        self.pool, self.page_size, self.size, self.stats = pool, page_size, size, stats
        self._kept: collections.OrderedDict[str, tuple[tuple[int, ...], list[int]]] = (
            collections.OrderedDict()
        )

    def __bool__(self) -> bool:
        return bool(self._kept)

    def kept_tokens(self, excluding: Collection[str] = ()) -> int:
        """The tokens the kept sessions' pages hold, the sessions in ``excluding`` left out.
        Safe beside the engine's thread: the ledger is copied by one ``list`` call (atomic
        under the GIL) before it is read."""
        kept = list(self._kept.items())
        return sum(len(tokens) for sid, (tokens, _) in kept if sid not in excluding)

    def take(self, n: int) -> list[int] | None:
        """``n`` free pages, evicting kept sessions (least recently used first) if need be."""
        while n > self.pool.available and self._kept:
            self.pool.release(self._kept.popitem(last=False)[1][1])
            self.stats.sessions_evicted += 1
        pages = self.pool.take(n)
        if pages is not None:
            self.stats.peak_pages_in_use = max(self.stats.peak_pages_in_use, self.pool.in_use)
        return pages

    def cached_prefix(
        self, request: GenerateRequest, seq: tuple[int, ...]
    ) -> tuple[list[int], int]:
        """Pages (held now, once more) that hold the longest cached prefix of ``seq`` and how
        many of its tokens they hold: from the request's session (or, for a session not
        kept, the one it continues: ``prefix_session``), or from any sequence's full pages
        (the episodes of a group share their prompt's). At least one token is left to
        prefill. A session continued by its own next request is handed over, not copied."""
        limit = len(seq) - 1
        shared = self.pool.lookup(prefix_keys(seq[:limit], self.page_size))
        ids = (request.session_id, request.prefix_session)
        session_id = next((s for s in ids if s is not None and s in self._kept), None)
        if session_id is None:
            return shared, len(shared) * self.page_size
        tokens, pages = self._kept[session_id]
        self._kept.move_to_end(session_id)
        common = 0
        for a, b in zip(tokens[:limit], seq, strict=False):
            if a != b:
                break
            common += 1
        if common <= len(shared) * self.page_size:
            return shared, len(shared) * self.page_size
        self.pool.release(shared)
        mine = pages[: -(-common // self.page_size)]
        self.pool.retain(mine)
        if session_id == request.session_id:  # its own next turn: the session moves on
            self.pool.release(self._kept.pop(session_id)[1])
        return mine, common

    def private_tail(self, pages: list[int], common: int, copy: Callable[[int, int], None]) -> bool:
        """Makes the page that position ``common`` (the first to be written) falls in the
        sequence's own: a page someone else holds, or one registered as a cached prefix, is
        copied first (``copy(page, fresh)`` copies its contents). False if no page is left
        for the copy."""
        index = common // self.page_size
        if index == len(pages):
            return True
        page = pages[index]
        if self.pool.refs(page) == 1 and not self.pool.is_registered(page):
            return True
        fresh = self.take(1)
        if fresh is None:
            return False
        copy(page, fresh[0])
        self.pool.release([page])
        pages[index] = fresh[0]
        return True

    def keep(self, session_id: str, tokens: tuple[int, ...], pages: list[int]) -> None:
        """``session_id``'s pages now (they hold ``tokens``), replacing what it kept."""
        old = self._kept.pop(session_id, None)
        if old is not None:
            self.pool.release(old[1])
        self._kept[session_id] = (tokens, pages)
        while len(self._kept) > self.size:
            self.pool.release(self._kept.popitem(last=False)[1][1])

    def drop(self) -> None:
        """Forgets every kept session and cached prefix (they belong to old weights)."""
        while self._kept:
            self.pool.release(self._kept.popitem()[1][1])
        self.pool.drop_cache()
