"""The KV pool's page allocator: pure bookkeeping of which fixed-size pages are free (no tensors).

Pages are numbered ``1..pages``; page 0 is the pool's *null page*, never handed out: padding rows and
unused entries of a page table point at it. The lowest free page is handed out first, so the pages in use
stay packed at the bottom of the pool and its storage only grows as far as the most pages ever held at
once. Every page is interchangeable (one size), so freed pages serve any later request: there is no
fragmentation to compact.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class PageAllocator:
    def __init__(self, pages: int) -> None:
        if pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {pages}")
        self.pages = pages
        self._free = list(range(1, pages + 1))  # a min-heap (a sorted list is one)
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, lowest first; None (and nothing taken) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        got = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(got)
        return got

    def release(self, pages: Iterable[int]) -> None:
        """Give ``pages`` back; a page that is not in use (a double free) is an error."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not in use")
            self._used.remove(p)
            heapq.heappush(self._free, p)

    def highest_used(self) -> int:
        """The highest page id in use (0 when none): how far the pool's storage must reach."""
        return max(self._used, default=0)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // page_size)


def round_up(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step


def pool_pages(kv_budget_tokens: int | None, page_size: int, max_batch: int, context_length: int) -> int:
    """Pages of one replica's KV pool: the KV budget rounded up to whole pages, or (no budget) room for
    ``max_batch`` requests of ``context_length`` tokens (+1: a decode step writes the token it reads)."""
    if kv_budget_tokens is not None:
        return pages_for(kv_budget_tokens, page_size)
    return max_batch * pages_for(context_length + 1, page_size)
