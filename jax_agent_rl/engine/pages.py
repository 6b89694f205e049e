"""The host's ledger of a KV page pool: which pages are free, who holds each, which hold a
known prefix.

A page is *held* while its reference count is above zero (a sequence decoding in it, a kept
session, a sequence sharing a prefix). A page that no one holds but whose contents are a
known prefix (`register`: a chain hash of every token up to the page's end) stays *cached*:
a later sequence with the same prefix takes it back (`lookup`) instead of computing it
again; it is reused for new contents only when no free page is left (least recently
released first). `drop_cache` forgets every prefix (new weights make them stale).

Pure bookkeeping over page ids: the engine owns the pool's buffers (`models.KVPages`).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np


def prefix_keys(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """A key per full page of ``tokens``: key i names tokens ``0 .. (i + 1) * page_size - 1``
    (a chain of BLAKE2b digests, so equal keys mean equal prefixes, not just equal pages)."""
    keys, key = [], b""
    for end in range(page_size, len(tokens) + 1, page_size):
        page = np.asarray(tokens[end - page_size : end], np.int64).tobytes()
        key = hashlib.blake2b(key + page, digest_size=16).digest()
        keys.append(key)
    return keys


class PagePool:
    """Reference counts, the free list and the prefix cache of ``num_pages`` pages."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_pages)
        )
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}

    @property
    def available(self) -> int:
        """Pages `take` can hand out now (free, or cached and reusable)."""
        return len(self._free) + len(self._cached)

    @property
    def in_use(self) -> int:
        """Pages someone holds."""
        return self.num_pages - self.available

    def refs(self, page: int) -> int:
        return self._refs[page]

    def is_registered(self, page: int) -> bool:
        """Whether the page holds a cached prefix (its contents must not change)."""
        return page in self._key_of

    def take(self, n: int) -> list[int] | None:
        """``n`` pages, each held once by the caller; ``None`` (and nothing taken) if fewer
        are available. Free pages go first, then the least recently released cached ones
        (their prefixes forgotten)."""
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page, _ = self._free.popitem(last=False)
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
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
                    self._cached[page] = None
                else:
                    self._free[page] = None

    def register(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Records that ``pages[i]`` holds the prefix named ``keys[i]`` (pages held by the
        caller; a prefix cached in another page already keeps that one)."""
        for page, key in zip(pages, keys, strict=False):
            if key in self._page_of or page in self._key_of:
                continue
            self._page_of[key] = page
            self._key_of[page] = key

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest cached prefix among ``keys`` (key 0 first), each now held
        once more by the caller."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
            pages.append(page)
        return pages

    def drop_cache(self) -> None:
        """Forgets every prefix: cached pages become free, held ones plain pages."""
        for page in self._cached:
            self._free[page] = None
        self._cached.clear()
        self._key_of.clear()
        self._page_of.clear()
