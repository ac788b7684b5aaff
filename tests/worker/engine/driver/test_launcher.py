"""Noticing a dead rank and naming the culprit without waiting: a rank's exit is seen the moment it happens
(its pidfd), and a rank that died without a report of its own is named before the peers it failed."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from rollout_worker.engine import messages as m
from rollout_worker.engine.driver.launcher import RankProcesses

from tests.waiting import wait_until


def _sleeping_rank() -> None:
    """A rank that only sleeps, with the default SIGTERM (a fork child inherits the test process's handler,
    and an in-process CLI test earlier in the session may have left a no-op one there)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(120)


class FakeRanks(RankProcesses):
    """Three sleeping processes as ranks (no engine, no torch) and the report pipe they would write to."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self._reader, self.writer = ctx.Pipe(duplex=False)
        self._writer = ctx.Pipe(duplex=False)[1]
        self.procs = [ctx.Process(target=_sleeping_rank) for _ in range(3)]
        self.inboxes = []
        self._guard = threading.Lock()
        self._exits, self.deaths, self.reported = {}, [], set()
        self._exits_lock = threading.Lock()
        self.stopping = False


@pytest.fixture
def ranks() -> Iterator[FakeRanks]:
    procs = FakeRanks()
    procs.start()
    yield procs
    procs.stop(grace_s=0)


def _kill(ranks: FakeRanks, rank: int, sig: int = signal.SIGKILL) -> None:
    """Kill a rank and return once it has exited (not necessarily reaped: its parent has not looked yet)."""
    pid = ranks.procs[rank].pid
    assert pid is not None
    fd = os.pidfd_open(pid)
    os.kill(pid, sig)
    exited = select.select([fd], [], [], 60)[0]
    os.close(fd)
    assert exited, f"rank {rank} did not exit on signal {sig}"


def test_a_killed_rank_is_reported_as_soon_as_it_exits(ranks: FakeRanks) -> None:
    _kill(ranks, 1)
    got = ranks.receive(timeout=60)  # wakes at the exit, not after 60 s
    assert got == [m.Failed(1, "rank 1 was killed by signal 9", "")]
    assert ranks.blame(got[0]) == "rank 1 was killed by signal 9"
    assert ranks.receive(timeout=0) == []  # once


def test_a_peer_that_reports_the_dead_ranks_failure_is_not_blamed(ranks: FakeRanks) -> None:
    _kill(ranks, 1)
    ranks.writer.send(m.Failed(0, "RuntimeError: Connection closed by peer", "tb"))
    got = ranks.receive(timeout=60)
    assert got[0] == m.Failed(0, "RuntimeError: Connection closed by peer", "tb")
    assert ranks.blame(got[0]) == (
        "rank 1 was killed by signal 9; rank 0 then failed: RuntimeError: Connection closed by peer"
    )


def test_a_rank_that_reported_its_own_failure_then_exited_is_the_culprit(ranks: FakeRanks) -> None:
    ranks.writer.send(m.Failed(2, "RuntimeError: boom", "tb"))
    _kill(ranks, 2, signal.SIGTERM)  # as a rank ends after its report
    got = ranks.receive(timeout=60)
    assert got == [m.Failed(2, "RuntimeError: boom", "tb")]
    assert ranks.blame(got[0]) == "rank 2 failed: RuntimeError: boom"
    more: list[m.Report] = []  # the report can be read before the exit is noticed (seen under load)

    def exit_noticed() -> bool:
        more.extend(ranks.receive(timeout=0.05))
        return 2 in ranks.deaths

    wait_until(exit_noticed, what="rank 2's exit noticed", timeout=10)
    assert more == [] and ranks.deaths == [2]  # its exit is no second failure


def test_no_peer_died(ranks: FakeRanks) -> None:
    ranks.writer.send(m.Failed(2, "RuntimeError: boom", "tb"))
    got = ranks.receive(timeout=60)
    assert [ranks.blame(f) for f in got if isinstance(f, m.Failed)] == ["rank 2 failed: RuntimeError: boom"]


def test_a_stop_while_starting_leaves_no_rank_and_a_later_start_is_refused() -> None:
    from rollout_worker.errors import EngineError

    procs = FakeRanks()
    procs.stop(grace_s=0)
    with pytest.raises(EngineError, match="stopped before its ranks started"):
        procs.start()
    assert all(p.pid is None for p in procs.procs)
