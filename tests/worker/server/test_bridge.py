"""The bridge's hold on request ids (issue 35): a request refused for an id another one holds touches nothing
of that one; an id is held until the engine's last update of it has been delivered, also after its client
went away, so that no update of an old request reaches a new one of the same id."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from rollout_worker.engine.driver.engine import Engine
from rollout_worker.engine.driver.request_table import Update
from rollout_worker.engine.finish import FinishAbort, FinishLength
from rollout_worker.engine.messages import TokenOut
from rollout_worker.errors import UserError
from rollout_worker.server.bridge import AsyncEngine


class Aborts:
    """The one engine verb the bridge calls: what it asked to abort."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def abort(self, rids: Any, message: str) -> int:
        self.asked.append(list(rids))
        return len(rids)


def _bridge() -> tuple[AsyncEngine, Aborts]:
    bridge, engine = AsyncEngine(), Aborts()
    bridge.bind(cast(Engine, engine), asyncio.get_running_loop())
    return bridge, engine


def _drain(q: asyncio.Queue[Update]) -> list[Update]:
    return [q.get_nowait() for _ in range(q.qsize())]


def test_a_refused_open_leaves_the_holder_untouched() -> None:
    async def run() -> None:
        bridge, engine = _bridge()
        first = bridge.open(["a-0", "a-1"])
        with pytest.raises(UserError, match="'a-1' is already in flight") as err:
            bridge.open(["b", "a-1"])
        assert err.value.field == "rid"
        bridge.listener([Update("a-1", tokens=(TokenOut("a-1", 5),)), Update("b", finish=FinishLength(1))])
        await asyncio.sleep(0)
        assert [u.rid for u in _drain(first)] == ["a-1"]  # still the holder's; "b" was never taken
        second = bridge.open(["b"])  # (so it can be taken now)
        bridge.close(second, ["b"], abort=False)
        assert engine.asked == []

    asyncio.run(run())


def test_an_id_is_held_until_its_last_update_is_delivered() -> None:
    async def run() -> None:
        bridge, engine = _bridge()
        q = bridge.open(["x", "y"])
        bridge.listener([Update("y", finish=FinishLength(3))])  # y finished: its id is free at once
        await asyncio.sleep(0)
        assert [u.rid for u in _drain(q)] == ["y"]
        bridge.close(bridge.open(["y"]), ["y"], abort=False)
        bridge.close(q, ["x", "y"])  # the client went away: x is aborted, y left alone
        assert engine.asked == [["x"]]
        with pytest.raises(UserError, match="'x' is already in flight"):
            bridge.open(["x"])  # the abort is on its way
        bridge.listener([Update("x", finish=FinishAbort("client disconnected"))])
        await asyncio.sleep(0)
        again = bridge.open(["x"])  # free once the old request's finish went by
        bridge.listener([Update("x", tokens=(TokenOut("x", 7),))])
        await asyncio.sleep(0)
        assert [(u.rid, u.finish) for u in _drain(again)] == [("x", None)]  # only the new request's
        assert _drain(q) == []  # nor did the old request's queue get anything after it was closed

    asyncio.run(run())


def test_closing_finished_requests_asks_nothing_of_the_engine() -> None:
    """Every HTTP request closes its requests when it ends: once they all finished, that is no abort (the
    engine's abort takes the lock the reader thread holds while it applies a step report)."""

    async def run() -> None:
        bridge, engine = _bridge()
        q = bridge.open(["done-0", "done-1"])
        bridge.listener([Update(rid, finish=FinishLength(2)) for rid in ("done-0", "done-1")])
        await asyncio.sleep(0)
        bridge.close(q, ["done-0", "done-1"])
        assert engine.asked == []

    asyncio.run(run())
