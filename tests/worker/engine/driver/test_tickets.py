"""The ticket table: replies counted per ticket, a plan's ticket forgotten once answered."""

from __future__ import annotations

import pytest
from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.engine.driver.tickets import Tickets
from rollout_worker.engine.messages import Done
from rollout_worker.scheduling.layout import Layout


def _done(ticket: int, rank: int, ok: bool = True) -> Done:
    return Done(ticket, rank, ok)


def test_complete_after_every_expected_reply() -> None:
    t = Tickets()
    a, b = t.open(2), t.open(1)
    assert a != b and len(t) == 2
    t.reply(a, _done(a, 0))
    assert not t.complete(a) and not t.complete(b)
    t.reply(a, _done(a, 1, ok=False))
    assert t.complete(a) and not t.complete(b)
    assert t.take(a) == [_done(a, 0), _done(a, 1, ok=False)]
    assert not t.complete(a) and t.take(a) == [] and len(t) == 1  # taken once


def test_a_waiter_that_gives_up_gets_what_came_and_late_replies_are_ignored() -> None:
    t = Tickets()
    a = t.open(4)
    t.reply(a, _done(a, 0))
    assert t.take(a) == [_done(a, 0)]
    t.reply(a, _done(a, 1))  # after the waiter gave up
    t.reply(999, _done(999, 0))  # never opened
    assert len(t) == 0


def test_a_ticket_nobody_awaits_is_forgotten_once_answered() -> None:
    t = Tickets()
    plan = t.open(1, awaited=False)
    event = ReconfigEvent(
        step=0, time_s=0, src=Layout(2, 1), dst=Layout(1, 2), requested="auto", method="migrate", reason="x"
    )
    t.reply(plan, event)
    assert len(t) == 0 and not t.complete(plan)


def test_a_ticket_expects_a_reply() -> None:
    with pytest.raises(ValueError, match="at least one reply"):
        Tickets().open(0)
