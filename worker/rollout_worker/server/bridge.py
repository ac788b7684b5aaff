"""The engine seen from asyncio: submitting never blocks the event loop for more than a lock's worth, the
slow verbs run in worker threads, and progress arrives through one ``call_soon_threadsafe`` per rank report
(fanned out to per-request queues on the loop).

A request id belongs to one HTTP request from :meth:`AsyncEngine.open` until the engine's last update of it
(its finish) has been delivered: another request with that id is refused meanwhile, also after its client
went away and while the abort is on its way, so that no update of an old request reaches a new one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from rollout_worker.engine.driver.engine import Engine
from rollout_worker.engine.driver.request_table import Update
from rollout_worker.errors import UserError

T = TypeVar("T")
# Work for at most this many requests (a body's jobs, their outputs) runs on the event loop: a worker
# thread's round trip costs more than it; more runs in a worker thread, so that a batch never holds the loop.
INLINE_REQUESTS = 16


class AsyncEngine:
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # request id -> the queue of the HTTP request that holds it; None: its client went away (it is being
        # aborted, its updates dropped)
        self._routes: dict[str, asyncio.Queue[Update] | None] = {}

    def bind(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop

    def listener(self, updates: list[Update]) -> None:
        """Called on the engine's reader thread."""
        if updates and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._deliver, updates)

    def _deliver(self, updates: list[Update]) -> None:
        routes = self._routes
        for u in updates:
            if u.rid in routes:
                q = routes[u.rid] if u.finish is None else routes.pop(u.rid)  # a finish frees the id
                if q is not None:
                    q.put_nowait(u)

    def open(self, rids: list[str]) -> asyncio.Queue[Update]:
        """One queue for the updates of these requests (one HTTP request's worth). Refused (naming ``rid``)
        when another request holds one of these ids: nothing changes then."""
        taken = next((rid for rid in rids if rid in self._routes), None)
        if taken is not None:
            raise UserError(f"a request with id {taken!r} is already in flight", "rid")
        q: asyncio.Queue[Update] = asyncio.Queue()
        for rid in rids:
            self._routes[rid] = q
        return q

    def close(self, q: asyncio.Queue[Update], rids: list[str], abort: bool = True) -> None:
        """Forget the requests of ``q`` (from :meth:`open`); with ``abort``, abort those of them that have not
        finished (the client went away), their ids held until the abort's finish arrives. Without, they are
        freed at once: the engine never accepted them."""
        left = [rid for rid in rids if self._routes.get(rid) is q]
        if not abort or self.engine is None:
            for rid in left:
                self._routes.pop(rid, None)  # (an id given twice is in ``left`` twice)
            return
        if not left:  # every one finished: nothing to abort (and no need of the engine's lock)
            return
        for rid in left:
            self._routes[rid] = None
        self.engine.abort(left, "client disconnected")

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

    async def work(self, requests: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, work in proportion to ``requests``: on the loop when that is little
        (:data:`INLINE_REQUESTS`), else in a worker thread."""
        return fn(*args) if requests <= INLINE_REQUESTS else await asyncio.to_thread(fn, *args)
