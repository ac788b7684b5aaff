"""Noticing a dead rank: a peer's failure report can arrive before the dead rank is reaped, so the driver
waits for the death itself (not a fixed sleep) before naming the culprit."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator

import pytest
from rollout_worker.engine.launcher import RankProcesses


@pytest.fixture
def ranks() -> Iterator[RankProcesses]:
    procs = RankProcesses.__new__(RankProcesses)  # only the processes: no engine, no torch
    procs.procs = [mp.get_context("fork").Process(target=time.sleep, args=(120,)) for _ in range(3)]
    for p in procs.procs:
        p.start()
    yield procs
    for p in procs.procs:
        p.kill()
        p.join(5)


def test_a_killed_peer_is_found_as_soon_as_it_is_reaped(ranks: RankProcesses) -> None:
    pid = ranks.procs[1].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert ranks.dead_besides(0, within_s=60.0) == [1]  # waits for the death, not for 60 s
    assert ranks.procs[1].exitcode == -signal.SIGKILL
    assert ranks.dead_besides(1, within_s=0.01) == []  # the reporter itself is not its own peer


def test_no_peer_died(ranks: RankProcesses) -> None:
    assert ranks.dead_besides(2, within_s=0.01) == []
