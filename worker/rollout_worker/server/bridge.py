"""The engine seen from asyncio: submitting never blocks the event loop for more than a lock's worth, the
slow verbs run in worker threads, and progress arrives through one ``call_soon_threadsafe`` per rank report
(fanned out to per-request queues on the loop)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from rollout_worker.engine.book import Update
from rollout_worker.engine.driver import Engine

T = TypeVar("T")


class AsyncEngine:
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[Update]] = {}

    def bind(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop

    def listener(self, updates: list[Update]) -> None:
        """Called on the engine's reader thread."""
        if updates and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._deliver, updates)

    def _deliver(self, updates: list[Update]) -> None:
        for u in updates:
            q = self._queues.get(u.rid)
            if q is not None:
                q.put_nowait(u)

    def open(self, rids: list[str]) -> asyncio.Queue[Update]:
        """One queue for the updates of these requests (one HTTP request's worth)."""
        q: asyncio.Queue[Update] = asyncio.Queue()
        for rid in rids:
            self._queues[rid] = q
        return q

    def close(self, rids: list[str], abort: bool) -> None:
        """Forget the requests' queue; abort the ones still running (the client went away)."""
        for rid in rids:
            self._queues.pop(rid, None)
            if abort and self.engine is not None:
                self.engine.abort(rid, "client disconnected")

    @staticmethod
    async def batches(q: asyncio.Queue[Update], rids: list[str]) -> AsyncIterator[list[Update]]:
        """Updates in arrival order, as many as are waiting at a time (a slow consumer gets fewer, larger
        batches), until every request has finished."""
        left = set(rids)
        while left:
            batch = [await q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            left.difference_update(u.rid for u in batch if u.finish is not None)
            yield batch

    async def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a blocking engine verb in a worker thread."""
        return await asyncio.to_thread(fn, *args, **kw)
