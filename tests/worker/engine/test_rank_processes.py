"""A running engine's rank processes: they listen on loopback only (the rendezvous store included: torch's
``tcp://`` rendezvous listened on every interface), and when one is killed the engine fails at once (no
moment of "ready"), naming the killed rank first."""

from __future__ import annotations

import ipaddress
import os
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_worker.api.requests import parse_request
from rollout_worker.engine.driver.engine import Engine
from rollout_worker.engine.driver.lifecycle import Health
from rollout_worker.engine.driver.request_table import Update

from tests.waiting import wait_until
from tests.worker.engine.engine_util import config
from tests.worker.server.served import listening

pytestmark = pytest.mark.multiproc
FAILED_WITHIN_S = 0.4  # after the exit; the old driver waited 0.5 s for a peer to die before failing


@pytest.fixture(scope="module")
def engine(tiny64: Path) -> Iterator[tuple[Engine, list[Update]]]:
    updates: list[Update] = []
    eng = Engine(config(tiny64, 2, "1x2"), listener=updates.extend)  # TP 2: rank 0 needs rank 1
    with eng:
        yield eng, updates


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def test_the_ranks_listen_on_loopback_only(engine: tuple[Engine, list[Update]]) -> None:
    eng, _ = engine
    for rank, pid in enumerate(eng.rank_pids):
        assert pid is not None
        sockets = listening(pid)
        assert sockets, f"rank {rank} listens nowhere: the check would prove nothing"
        assert all(_loopback(addr) for addr, _ in sockets), f"rank {rank} listens on {sockets}"


def test_a_killed_rank_fails_the_engine_at_once_and_is_named_first(
    engine: tuple[Engine, list[Update]],
) -> None:
    eng, updates = engine
    spec = {"id": "long", "input_ids": [1, 2, 3], "max_new_tokens": 2000, "ignore_eos": True}
    eng.submit(parse_request(spec, "test", None, 512))
    wait_until(lambda: sum(len(u.tokens) for u in updates) >= 3, what="3 tokens decoded", timeout=30)
    pid = eng.rank_pids[1]
    assert pid is not None
    fd = os.pidfd_open(pid)
    os.kill(pid, signal.SIGKILL)
    assert select.select([fd], [], [], 30)[0], "rank 1 did not exit"
    exited = time.monotonic()
    os.close(fd)
    wait_until(lambda: eng.status.health is Health.FAILED, what="the engine to fail", timeout=FAILED_WITHIN_S)
    assert time.monotonic() - exited < FAILED_WITHIN_S
    failure = eng.status.failure or ""
    assert failure.startswith("rank 1 was killed by signal 9"), failure
    wait_until(lambda: any(u.finish is not None for u in updates), what="the request's end", timeout=10)
    finish = [u.finish for u in updates if u.finish is not None]
    assert len(finish) == 1 and "rank 1 was killed by signal 9" in str(finish[0]), finish
