"""The host's ledger of a KV page pool: which pages are free, who holds each, which hold a
known prefix.

A page is *held* while its reference count is above zero (a sequence decoding in it, a kept
session, a sequence sharing a prefix). A page that no one holds but whose contents are a
known prefix (`register`: a chain hash of every token up to the page's end) stays *cached*:
a later sequence with the same prefix takes it back (`lookup`) instead of computing it
again; it is reused for new contents only when no free page is left (least recently
released first).

Keys and values depend on the weights that computed them, so the pool stamps each page with
the weight version current when it was taken (``version``; a copy takes its source's stamp):
`oldest` says which weights computed the oldest keys and values a sequence attends to. A
prefix's key is salted with a version (`keys`): a sequence registers its pages under the
oldest version of its keys and values and looks prefixes up under the current one, so a
prefix computed (wholly or in part) under other weights is never found, and ages out as
pages run short. (An engine that keeps KV over a push, ``engine.keep_kv_on_update``, keeps
it for running requests and kept sessions, never for the shared prefixes: a prefix every
prompt starts with, a system prompt, would be reused from the first weights on forever.)

The pool splits into ``shards`` contiguous page ranges, one per shard of the decode slots
(the pool's page axis splits over the mesh like the slots: `models.PAGE_AXES`): shard d owns
pages ``d * shard_pages .. (d + 1) * shard_pages - 1``, and a slot decoded on shard d takes
and shares pages of that range only, so its attention reads its own device's pages. Each
shard keeps its own free list and prefix cache: a prefix cached on another shard is not
found (`lookup` names the shard), and is computed again on this one.

Pure bookkeeping over page ids: the engine owns the pool's buffers (`models.KVPages`).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np


def prefix_keys(tokens: Sequence[int], page_size: int, salt: int) -> list[bytes]:
    """A key per full page of ``tokens``: key i names tokens ``0 .. (i + 1) * page_size - 1``
    (a chain of BLAKE2b digests, so equal keys mean equal prefixes, not just equal pages),
    computed under weight version ``salt`` (`PagePool.keys`)."""
    keys, key = [], salt.to_bytes(8, "little", signed=True)
    for end in range(page_size, len(tokens) + 1, page_size):
        page = np.asarray(tokens[end - page_size : end], np.int64).tobytes()
        key = hashlib.blake2b(key + page, digest_size=16).digest()
        keys.append(key)
    return keys


class PagePool:
    """Reference counts, free lists and prefix caches of ``num_pages`` pages in ``shards``
    equal contiguous ranges, stamped with weight ``version`` (see the module docstring)."""

    def __init__(self, num_pages: int, shards: int = 1, version: int = 0) -> None:
        if shards < 1 or num_pages % shards:
            raise ValueError(f"{num_pages} pages do not split into {shards} equal shards")
        self.num_pages, self.shards = num_pages, shards
        self.version = version
        self._stamp = [version] * num_pages  # the version current when each page was taken
        self.shard_pages = num_pages // shards
        self._refs = [0] * num_pages
        self._free = [
            collections.OrderedDict.fromkeys(
                range(d * self.shard_pages, (d + 1) * self.shard_pages)
            )
            for d in range(shards)
        ]
        self._cached: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(shards)
        ]
        self._key_of: dict[int, bytes] = {}
        self._page_of: list[dict[bytes, int]] = [{} for _ in range(shards)]

    def shard_of(self, page: int) -> int:
        """The shard whose range holds ``page``."""
        return page // self.shard_pages

    def available(self, shard: int) -> int:
        """Pages `take` can hand out now on ``shard`` (free, or cached and reusable)."""
        return len(self._free[shard]) + len(self._cached[shard])

    @property
    def in_use(self) -> int:
        """Pages someone holds, on every shard."""
        return self.num_pages - sum(self.available(d) for d in range(self.shards))

    def refs(self, page: int) -> int:
        return self._refs[page]

    def keys(
        self, tokens: Sequence[int], page_size: int, version: int | None = None
    ) -> list[bytes]:
        """`prefix_keys` of ``tokens`` salted with weight ``version`` (None: the current one):
        pages are registered under the oldest version of their keys and values, looked up
        under the current one."""
        return prefix_keys(tokens, page_size, self.version if version is None else version)

    def oldest(self, pages: Iterable[int]) -> int:
        """The oldest weight version that computed keys and values in ``pages`` (the current
        one for none)."""
        return min((self._stamp[page] for page in pages), default=self.version)

    def copied(self, src: int, dst: int) -> None:
        """Page ``dst`` now holds ``src``'s keys and values: it takes ``src``'s stamp."""
        self._stamp[dst] = self._stamp[src]

    def is_registered(self, page: int) -> bool:
        """Whether the page holds a cached prefix (its contents must not change)."""
        return page in self._key_of

    def take(self, n: int, shard: int) -> list[int] | None:
        """``n`` pages of ``shard``, each held once by the caller; ``None`` (and nothing
        taken) if fewer are available there. Free pages go first, then the least recently
        released cached ones (their prefixes forgotten)."""
        if n > self.available(shard):
            return None
        free, cached = self._free[shard], self._cached[shard]
        pages = []
        for _ in range(n):
            if free:
                page, _ = free.popitem(last=False)
            else:
                page, _ = cached.popitem(last=False)
                del self._page_of[shard][self._key_of.pop(page)]
            self._refs[page] = 1
            self._stamp[page] = self.version
            pages.append(page)
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """One more holder of each page (each must be held already)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is not held: it cannot be shared")
            self._refs[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One holder less of each page; a page no one holds is cached if it holds a known
        prefix, else free."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is released more often than it is held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._cached[self.shard_of(page)][page] = None
                else:
                    self._free[self.shard_of(page)][page] = None

    def register(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Records that ``pages[i]`` holds the prefix named ``keys[i]`` (pages held by the
        caller; a prefix cached in another page of the same shard already keeps that one)."""
        for page, key in zip(pages, keys, strict=False):
            index = self._page_of[self.shard_of(page)]
            if key in index or page in self._key_of:
                continue
            index[key] = page
            self._key_of[page] = key

    def cached(self, keys: Sequence[bytes], shard: int) -> int:
        """How many of ``keys`` (key 0 first) ``shard`` holds as a cached prefix (nothing is
        held by asking)."""
        index = self._page_of[shard]
        return next((i for i, key in enumerate(keys) if key not in index), len(keys))

    def lookup(self, keys: Sequence[bytes], shard: int) -> list[int]:
        """The pages of ``shard`` that hold the longest prefix among ``keys`` cached there
        (key 0 first), each now held once more by the caller."""
        index = self._page_of[shard]
        pages = []
        for key in keys:
            page = index.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._cached[shard][page]
            self._refs[page] += 1
            pages.append(page)
        return pages
