"""The engine's health: every allowed move, every refused one, and the failure kept through stopping."""

from __future__ import annotations

import itertools

import pytest
from rollout_worker.engine.driver.lifecycle import Health, Lifecycle, Status
from rollout_worker.errors import Unavailable

H = Health
ALLOWED = {
    (H.STARTING, H.READY),
    (H.STARTING, H.FAILED),
    (H.STARTING, H.STOPPING),
    (H.READY, H.FAILED),
    (H.READY, H.STOPPING),
    (H.FAILED, H.STOPPING),
    (H.FAILED, H.STOPPED),
    (H.STOPPING, H.FAILED),
    (H.STOPPING, H.STOPPED),
}


def _at(health: Health) -> Lifecycle:
    life = Lifecycle()
    life.status = Status(health, "boom" if health is H.FAILED else None)
    return life


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(Health, Health)))
def test_moves(src: Health, dst: Health) -> None:
    life = _at(src)
    moved = life.move(dst, "why" if dst is H.FAILED else None)
    assert moved == ((src, dst) in ALLOWED)
    assert life.status.health is (dst if moved else src)


def test_a_start_fails_then_stops_and_keeps_the_reason() -> None:
    life = Lifecycle()
    assert life.status == Status(H.STARTING, None) and not life.status.serving
    assert life.move(H.READY) and life.status.serving
    assert life.move(H.FAILED, "rank 1 exited")
    assert not life.move(H.FAILED, "a second failure")  # the first reason stays
    assert not life.move(H.READY)  # a late Ready report cannot revive it
    assert life.move(H.STOPPING) and life.move(H.STOPPED)
    assert life.status == Status(H.STOPPED, "rank 1 exited")


def test_shutdown_during_start_is_not_undone_by_the_ranks_ready() -> None:
    life = Lifecycle()
    assert life.move(H.STOPPING)
    assert not life.move(H.READY) and life.status.health is H.STOPPING


def test_check_serving_names_the_health_and_the_failure() -> None:
    Status(H.READY).check_serving()
    with pytest.raises(Unavailable, match=r"^engine is starting$"):
        Status().check_serving()
    with pytest.raises(Unavailable, match=r"^engine is failed: rank 1 exited$"):
        Status(H.FAILED, "rank 1 exited").check_serving()


def test_health_is_the_string_on_the_wire() -> None:
    assert [h.value for h in Health] == ["starting", "ready", "failed", "stopping", "stopped"]
    assert f"engine is {H.STOPPING}" == "engine is stopping"
