"""Pages of the byte cache: who holds them, and which ones the prefix cache can hand out again.

A page is a block of `page_size` token positions in every kv source's pools at once
(`model/cache.py`), so one page id covers a request's global KV, index keys of those tokens.

    PagePool      fixed set of page ids; a refcount per page; free pages on a free list
    PrefixCache   chained hashes of full page-sized token blocks -> the page that holds them;
                  a cached page no request references sits in an LRU list and is evicted (its id
                  freed) only when the pool runs dry

Invariants (docs/serving.md):
- a page is published to the prefix cache only when full and written by the request that owns
  it; from then on nobody writes it (a request that hits it replays those positions with
  writes_global False, `model/batch.py`);
- eviction takes only pages with refcount 0;
- the hash of block k chains the hashes of blocks 0..k-1, so equal blocks after different
  prefixes never share a page.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence


class PagePool:
    """Page ids 0..n-1 with refcounts; `allocate` takes free pages, `release` returns them."""

    def __init__(self, n_pages: int):
        if n_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {n_pages}")
        self.n_pages = n_pages
        self.refs = [0] * n_pages
        self.free = list(range(n_pages - 1, -1, -1))  # pop() hands out the lowest id first

    def allocate(self, n: int) -> list[int] | None:
        """n free pages with refcount 1, or None (and nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: Sequence[int]) -> list[int]:
        """Drop one reference of each; returns the pages that reached refcount 0 (the caller
        decides whether they go back to the free list or stay cached)."""
        unreferenced = []
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p} released more often than retained")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                unreferenced.append(p)
        return unreferenced


def block_hashes(tokens: Sequence[int], page_size: int) -> list[str]:
    """Chained hashes of the full page-sized blocks of `tokens`."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        digest = hashlib.blake2b(parent + b"|" + ",".join(map(str, tokens[start:start + page_size])).encode(),
                                 digest_size=16).hexdigest()
        hashes.append(digest)
        parent = digest.encode()
    return hashes


class PrefixCache:
    """Full pages of global KV by the chained hash of their tokens, over a PagePool."""

    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self.page_of: dict[str, int] = {}
        self.hash_of: dict[int, str] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; oldest first
        self.evicted = 0

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The pages of the longest cached prefix of full blocks, retained for the caller."""
        pages = []
        for h in block_hashes(tokens, self.page_size):
            page = self.page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for p in pages:
            self.evictable.pop(p, None)
        self.pool.retain(pages)
        return pages

    def publish(self, tokens: Sequence[int], pages: Sequence[int], written_upto: int) -> None:
        """Cache the full blocks of `tokens` below `written_upto` held in `pages` (a block already
        cached under its hash keeps its page: the newer copy stays private and is freed later)."""
        for k, h in enumerate(block_hashes(tokens[:written_upto], self.page_size)):
            if h not in self.page_of and pages[k] not in self.hash_of:
                self.page_of[h], self.hash_of[pages[k]] = pages[k], h

    def release(self, pages: Sequence[int]) -> None:
        """A request lets go of its pages: cached ones become evictable, the rest free."""
        for p in self.pool.release(pages):
            if p in self.hash_of:
                self.evictable[p] = None
            else:
                self.pool.free.append(p)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, evicting least recently released cached pages when the free list is short."""
        while len(self.pool.free) < n and self.evictable:
            page, _ = self.evictable.popitem(last=False)
            del self.page_of[self.hash_of.pop(page)]
            self.pool.free.append(page)
            self.evicted += 1
        return self.pool.allocate(n)

    def is_cached(self, page: int) -> bool:
        return page in self.hash_of
