"""The prefix cache's bookkeeping (pure): shared pages, keys by parent page, eviction, flush."""

from __future__ import annotations

import pytest
from rollout_worker.scheduling.pages import PageAllocator
from rollout_worker.scheduling.prefix_cache import SharedPages


def _pages(n: int = 8, ps: int = 2) -> SharedPages:
    return SharedPages(PageAllocator(n), ps)


def test_a_shared_page_is_freed_by_its_last_holder_only() -> None:
    s = SharedPages(PageAllocator(4), 2, cache=False)
    a = s.alloc(2)
    assert a == [1, 2] and s.available == 2 and s.held == 2
    s.acquire(a)  # a second holder
    s.release(a)
    assert s.available == 2 and s.holders(1) == 1
    s.release(a)
    assert s.available == 4 and s.held == 0
    with pytest.raises(ValueError, match="page 1 is not held"):
        s.release([1])


def test_match_finds_the_longest_page_aligned_prefix_within_the_limit() -> None:
    s = _pages()
    p = s.alloc(3)
    assert p is not None
    s.insert([1, 2, 3, 4, 5, 6, 7], p)  # full pages [1,2] [3,4] [5,6]; 7 is in no full page
    assert s.cached == 3
    assert s.match([1, 2, 3, 4, 5, 6, 7, 8], 7) == p
    assert s.match([1, 2, 3, 4, 5, 6], 5) == p[:2]  # the limit: at most 5 tokens, so 2 pages
    assert s.match([1, 2, 3, 9, 5, 6], 6) == p[:1]  # the second page differs
    assert s.match([3, 4], 2) == []  # [3,4] is cached only after [1,2]: the key names its parent
    assert SharedPages(PageAllocator(4), 2, cache=False).match([1, 2], 2) == []


def test_a_page_without_holders_stays_cached_until_it_is_needed() -> None:
    s = _pages(n=4)
    p = s.alloc(2)
    assert p is not None
    s.insert([1, 2, 3, 4], p)
    s.release(reversed(p))  # last page first: [3,4] is the oldest idle page
    assert s.held == 0 and s.available == 4 and s.cached == 2
    assert s.match([1, 2, 3, 4], 4) == p
    got = s.alloc(3)  # 2 free pages, so one idle page is evicted: the leaf [3,4], not its parent
    assert got is not None and sorted(got) == sorted([3, 4, p[1]])
    assert s.match([1, 2, 3, 4], 4) == p[:1] and s.cached == 1
    assert s.alloc(1) == [p[0]] and s.cached == 0  # the last idle page evicted too
    assert s.alloc(1) is None


def test_evicting_a_page_uncaches_the_pages_under_it() -> None:
    s = _pages(n=3)
    p = s.alloc(3)
    assert p is not None
    s.insert([1, 2, 3, 4, 5, 6], p)
    s.release(p)  # first page first: the parent is the oldest idle page
    got = s.alloc(1)
    assert got == [p[0]] and s.cached == 0  # its children's keys named it: they are gone, and freed
    assert s.available == 2


def test_acquiring_an_idle_page_takes_it_off_the_evictable_ones() -> None:
    s = _pages(n=2)
    p = s.alloc(1)
    assert p is not None
    s.insert([1, 2], p)
    s.release(p)
    assert s.available == 2 and s.is_idle(p[0])
    s.acquire(p)
    assert s.available == 1 and not s.is_idle(p[0]) and s.alloc(2) is None


def test_insert_keeps_a_prefix_cached_under_other_pages() -> None:
    s = _pages()
    a, b = s.alloc(2), s.alloc(2)
    assert a is not None and b is not None
    s.insert([1, 2, 3, 4], a)
    s.insert([1, 2, 3, 4], b)  # the same tokens computed twice: the first pages stay the cached ones
    assert s.match([1, 2, 3, 4], 4) == a and s.cached == 2
    s.release(b)
    assert s.available == 6 and s.held == 2  # b's pages were never cached: freed at once


def test_flush_frees_idle_pages_and_keeps_held_ones() -> None:
    s = _pages(n=4)
    a, b = s.alloc(1), s.alloc(1)
    assert a is not None and b is not None
    s.insert([1, 2], a)
    s.insert([3, 4], b)
    s.release(a)
    s.flush()
    assert s.cached == 0 and s.available == 3 and s.held == 1
    s.release(b)
    assert s.available == 4
