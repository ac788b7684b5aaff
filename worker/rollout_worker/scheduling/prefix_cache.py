"""Shared pages and the prefix cache of a KV pool: pure bookkeeping of which pages hold which token prefix,
who holds them, and which may be evicted (no tensors).

A full page is cached under the key ``(parent page, its tokens)``: the parent is the cached page of the
tokens before it (0, the null page, for a prompt's first page), so a key names a whole page-aligned prefix
exactly, without hashing, and the cache is a radix tree over pages (SGLang's RadixCache at page granularity,
vLLM's prefix hash chain without collisions). Requests whose token prefixes are equal hold the same pages;
a page is given back to the allocator when its last holder lets go and it is not cached, and a cached page
with no holder stays cached until the allocator needs it: least recently released first (a request's pages
are released last page first, so its leaves go before its parents), and evicting a page uncaches the
pages under it, whose keys name it.

Only full pages are cached: a prefill's as it writes them, a finished request's (prompt and output) as it
ends. A request never writes into a page it shares: it takes at most its prefill's tokens minus one from the
cache (the last token is always computed, for its logits), so its own writes start in a page of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from rollout_worker.scheduling.pages import PageAllocator

Key = tuple[int, tuple[int, ...]]  # (parent page, the page's tokens)


class SharedPages:
    """A :class:`PageAllocator` with reference counts and a prefix cache over full pages."""

    def __init__(self, allocator: PageAllocator, page_size: int, cache: bool = True) -> None:
        self.allocator, self.page_size, self.cache = allocator, page_size, cache
        self._refs: dict[int, int] = {}  # held pages -> holders
        self._page_of: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}
        self._children: dict[int, set[int]] = {}  # cached page -> cached pages whose key names it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, no holder: evictable, oldest first

    @property
    def pages(self) -> int:
        return self.allocator.pages

    @property
    def available(self) -> int:
        """Pages an allocation can get now: free ones and cached ones no request holds."""
        return self.allocator.free + len(self._idle)

    @property
    def held(self) -> int:
        """Pages some request holds."""
        return len(self._refs)

    @property
    def cached(self) -> int:
        return len(self._key_of)

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def holders(self, page: int) -> int:
        return self._refs.get(page, 0)

    # -- holding -------------------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """``n`` fresh pages for one holder, evicting idle cached pages if the free ones are too few; None
        (and nothing taken or evicted) when fewer than ``n`` are available."""
        if n > self.available:
            return None
        while self.allocator.free < n:
            self._evict(next(iter(self._idle)))
        got = self.allocator.alloc(n)
        assert got is not None
        for p in got:
            self._refs[p] = 1
        return got

    def acquire(self, pages: Iterable[int]) -> None:
        """One more holder of each of ``pages`` (cached pages a request shares)."""
        for p in pages:
            self._idle.pop(p, None)
            self._refs[p] = self._refs.get(p, 0) + 1

    def release(self, pages: Iterable[int]) -> None:
        """One holder fewer of each of ``pages``; a page without holders stays cached (idle) if it is
        cached, and is freed otherwise."""
        for p in pages:
            n = self._refs.get(p)
            if n is None:
                raise ValueError(f"page {p} is not held")
            if n > 1:
                self._refs[p] = n - 1
                continue
            del self._refs[p]
            if p in self._key_of:
                self._idle[p] = None
            else:
                self.allocator.release((p,))

    # -- the prefix cache ----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The cached pages of the longest page-aligned prefix of ``tokens`` of at most ``limit`` tokens."""
        if not self.cache:
            return []
        ps, parent, out = self.page_size, 0, []
        for i in range(min(limit, len(tokens)) // ps):
            page = self._page_of.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if page is None:
                break
            out.append(page)
            parent = page
        return out

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Cache the full pages of ``tokens`` held in ``pages`` (in position order). A prefix already cached
        under other pages keeps its pages, and the walk goes on under them."""
        if not self.cache:
            return
        ps, parent = self.page_size, 0
        for i in range(min(len(tokens) // ps, len(pages))):
            key: Key = (parent, tuple(tokens[i * ps : (i + 1) * ps]))
            page = self._page_of.get(key)
            if page is None:
                page = pages[i]
                if page in self._key_of:  # cached already under another prefix: the walk stops here
                    return
                self._page_of[key], self._key_of[page] = page, key
                if parent:
                    self._children.setdefault(parent, set()).add(page)
            parent = page

    def flush(self) -> None:
        """Empty the cache (new weights, ``/flush_cache``): idle pages are freed, held ones stay held."""
        self.allocator.release(self._idle)
        self._idle.clear()
        self._page_of.clear()
        self._key_of.clear()
        self._children.clear()

    def _evict(self, page: int) -> None:
        """Uncache ``page`` and every cached page under it; the idle ones among them are freed."""
        stack = [page]
        while stack:
            p = stack.pop()
            key = self._key_of.pop(p)
            del self._page_of[key]
            if key[0] in self._children:
                self._children[key[0]].discard(p)
            stack.extend(self._children.pop(p, ()))
            if p in self._idle:
                del self._idle[p]
                self.allocator.release((p,))
