"""The KV pool's page allocator: alloc, free, exhaustion, reuse with no fragmentation."""

from __future__ import annotations

import pytest
from rollout_worker.scheduling.pages import PageAllocator, pages_for, pool_pages


def test_alloc_hands_out_the_lowest_free_pages_and_never_the_null_page() -> None:
    a = PageAllocator(8)
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(2) == [4, 5]
    assert (a.used, a.free) == (5, 3)
    a.release([2, 4])
    assert a.alloc(1) == [2]  # the lowest free page first: storage stays packed at the bottom
    assert a.highest_used() == 5


def test_exhaustion_takes_nothing() -> None:
    a = PageAllocator(4)
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(2) is None  # one free page, two asked: all or nothing
    assert a.free == 1
    assert a.alloc(1) == [4]
    assert a.alloc(1) is None and a.alloc(0) == []


def test_freed_pages_serve_any_request_whatever_the_interleaving() -> None:
    """Fixed-size pages: after any pattern of frees the free count is allocatable at once by one request
    (no fragmentation), and every page id is handed out at most once at a time."""
    a = PageAllocator(32)
    held = [a.alloc(n) for n in (3, 5, 2, 7, 1, 6, 4)]  # 28 pages
    assert all(h is not None for h in held)
    for h in held[::2]:  # free every other request: holes all over the pool
        assert h is not None
        a.release(h)
    free = a.free
    assert free == 32 - sum(len(h or []) for h in held[1::2])
    big = a.alloc(free)
    assert big is not None and len(big) == free
    in_use = [p for h in held[1::2] for p in (h or [])] + big
    assert sorted(in_use) == list(range(1, 33))
    assert a.alloc(1) is None


def test_double_free_and_bad_sizes_are_errors() -> None:
    a = PageAllocator(2)
    got = a.alloc(1)
    assert got == [1]
    a.release(got)
    with pytest.raises(ValueError, match="not in use"):
        a.release([1])
    with pytest.raises(ValueError, match="not in use"):
        a.release([0])  # the null page is never handed out
    with pytest.raises(ValueError):
        a.alloc(-1)
    with pytest.raises(ValueError):
        PageAllocator(0)


def test_pool_size_from_the_budget() -> None:
    assert pages_for(0, 4) == 0 and pages_for(1, 4) == 1 and pages_for(8, 4) == 2 and pages_for(9, 4) == 3
    assert pool_pages(150, 16, 64, 2048) == 10  # the budget rounded up to whole pages
    assert pool_pages(150, 1, 64, 2048) == 150
    assert pool_pages(None, 16, 4, 100) == 4 * 7  # no budget: max_batch requests of context + 1 tokens
