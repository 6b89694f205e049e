"""`SessionPages`: the embedded backend's KV pages kept between requests.

A finished request of a session leaves its pages to the session (least recently used out,
``size`` sessions at most, and evicted when the pool runs short), so the session's next turn
prefills only what follows the longest common prefix; a branch of a tree rollout starts from
the session it continues (``prefix_session``). Every full page of a known prefix is also
registered in the pool (`PagePool.lookup`), so requests sharing a prompt share its pages.
On a sharded engine every page a request holds is on its slot's shard (`best_shard` picks
the shard): a session's pages, and the prefixes it finds, are those of one shard.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Collection, Iterable

from jax_agent_rl.engine.pages import PagePool
from jax_agent_rl.protocol import GenerateRequest


@dataclasses.dataclass
class BackendStats:
    """The embedded backend's running totals."""

    requests: int = 0
    prefilled_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from a session's cached prefix
    generated_tokens: int = 0
    decode_calls: int = 0
    # where an engine call's time goes: seconds from a call's dispatch to its tokens on the
    # host; the calls with a ragged step (prompt chunks beside the decode rows: the others
    # only decode) and the decode steps run; the rows the ragged steps and the decode steps
    # asked for, and the rows computed (padded to their buckets)
    call_s: float = 0.0
    step_calls: int = 0
    decode_steps: int = 0
    step_rows: int = 0
    step_rows_computed: int = 0
    decode_rows: int = 0
    decode_rows_computed: int = 0
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

    def _shard(self, session_id: str) -> int:
        """The shard whose pages the session holds (the one its slot decoded on)."""
        return self.pool.shard_of(self._kept[session_id][1][0])

    def take(self, n: int, shard: int) -> list[int] | None:
        """``n`` free pages of ``shard``, evicting kept sessions there (least recently used
        first) if need be."""
        while n > self.pool.available(shard):
            victim = next((s for s in self._kept if self._shard(s) == shard), None)
            if victim is None:
                break
            self.pool.release(self._kept.pop(victim)[1])
            self.stats.sessions_evicted += 1
        pages = self.pool.take(n, shard)
        if pages is not None:
            self.stats.peak_pages_in_use = max(self.stats.peak_pages_in_use, self.pool.in_use)
        return pages

    def best_slot(
        self,
        request: GenerateRequest,
        seq: tuple[int, ...],
        free: Iterable[int],
        slot_shard: Callable[[int], int],
        need: int,
    ) -> int:
        """The free slot (the first of its shard's) where ``seq``, which holds ``need``
        pages, starts best: on the shard where its pages fit (free, cached, or a kept
        session's to evict), then where most of it is cached already (its session's pages,
        or any sequence's full pages: a group's prompt), then where most pages are free. A
        prefix cached on another shard is not reused but computed again on this one: a copy
        would move every layer's keys and values between devices, and the prefill is of one
        sequence."""
        first: dict[int, int] = {}  # shard -> its first free slot
        for slot in free:
            first.setdefault(slot_shard(slot), slot)
        if len(first) == 1:
            return next(iter(first.values()))
        keys = self.pool.keys(seq[: len(seq) - 1], self.page_size)

        def rank(shard: int) -> tuple[bool, int, int]:
            session_id = self._session(request, shard)
            common = 0 if session_id is None else self._common(session_id, seq)
            cached = max(common, self.pool.cached(keys, shard) * self.page_size)
            kept = sum(len(p) for sid, (_, p) in self._kept.items() if self._shard(sid) == shard)
            room = self.pool.available(shard) + kept + -(-cached // self.page_size)
            return room >= need, cached, self.pool.available(shard)

        return first[max(sorted(first), key=rank)]

    def _session(self, request: GenerateRequest, shard: int) -> str | None:
        """The kept session whose pages the request starts from (its own, or for a session
        not kept the one it continues: ``prefix_session``), if it is on ``shard``."""
        ids = (request.session_id, request.prefix_session)
        session_id = next((s for s in ids if s is not None and s in self._kept), None)
        return None if session_id is None or self._shard(session_id) != shard else session_id

    def _common(self, session_id: str, seq: tuple[int, ...]) -> int:
        """Tokens of ``seq`` (all but its last) that the session's pages hold."""
        common = 0
        for a, b in zip(self._kept[session_id][0][: len(seq) - 1], seq, strict=False):
            if a != b:
                break
            common += 1
        return common

    def cached_prefix(
        self, request: GenerateRequest, seq: tuple[int, ...], shard: int
    ) -> tuple[list[int], int]:
        """Pages of ``shard`` (held now, once more) that hold the longest cached prefix of
        ``seq`` and how many of its tokens they hold: from the request's session (`_session`)
        or from any sequence's full pages (the episodes of a group share their prompt's). At
        least one token is left to prefill. A session continued by its own next request is
        handed over, not copied."""
        keys = self.pool.keys(seq[: len(seq) - 1], self.page_size)
        shared = self.pool.lookup(keys, shard)
        session_id = self._session(request, shard)
        if session_id is None:
            return shared, len(shared) * self.page_size
        self._kept.move_to_end(session_id)
        common = self._common(session_id, seq)
        if common <= len(shared) * self.page_size:
            return shared, len(shared) * self.page_size
        self.pool.release(shared)
        mine = self._kept[session_id][1][: -(-common // self.page_size)]
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
        fresh = self.take(1, self.pool.shard_of(page))
        if fresh is None:
            return False
        copy(page, fresh[0])
        self.pool.copied(page, fresh[0])
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
        """Forgets every kept session (their pages hold keys and values of old weights; the
        pool's cached prefixes need no dropping: new keys are salted with the new version)."""
        while self._kept:
            self.pool.release(self._kept.popitem()[1][1])
