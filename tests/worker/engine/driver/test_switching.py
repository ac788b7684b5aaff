"""The plan and the switch in flight, without processes: which plans are refused, one switch at a time,
a plan's switch answered without a waiter."""

from __future__ import annotations

import pytest
from rollout_worker.api.plan import Plan, ReconfigEvent, Trigger
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine import messages as m
from rollout_worker.engine.driver.request_table import RequestTable
from rollout_worker.engine.driver.switching import Switching
from rollout_worker.engine.driver.tickets import Tickets
from rollout_worker.engine.finish import FinishLength
from rollout_worker.errors import Conflict, UserError
from rollout_worker.scheduling.layout import Layout

CANDIDATES = (Layout(4, 1), Layout(2, 2), Layout(1, 4))


def _setup(n: int = 0) -> tuple[Switching, Tickets, list[m.Command]]:
    table, tickets, sent = RequestTable(Layout(4, 1)), Tickets(), []
    for i in range(n):
        table.add(RequestSpec(f"r{i}", (1,), 8, Sampling()), (), 0.0)
    table.dispatch()
    return Switching(table, tickets, sent.append, CANDIDATES), tickets, sent


def _plan(*triggers: tuple[int, Layout], based_on: Layout = Layout(4, 1)) -> Plan:
    trigs = [Trigger(unfinished_at_most=n, layout=lay) for n, lay in triggers]
    return Plan(based_on_layout=based_on, triggers=trigs)


def _switched(ticket: int, dst: Layout) -> m.Switched:
    ev = ReconfigEvent(
        step=0, time_s=0, src=Layout(4, 1), dst=dst, requested="auto", method="migrate", reason="x"
    )
    return m.Switched(ticket, ev, (), 1, 0)


def test_plans_are_refused_when_stale_or_off_the_candidates() -> None:
    sw, _, sent = _setup()
    with pytest.raises(Conflict, match="based on 2x2, but the engine is in 4x1") as exc:
        sw.set_plan(_plan((1, Layout(1, 4)), based_on=Layout(2, 2)))
    assert exc.value.field == "based_on_layout"
    with pytest.raises(UserError, match="3x1 is not among the candidate layouts") as bad:
        sw.set_plan(_plan((2, Layout(2, 2)), (1, Layout(3, 1))))
    assert bad.value.field == "triggers[1].layout"
    sw.start(Layout(2, 2), "auto", "requested")
    with pytest.raises(Conflict, match="engine is switching"):
        sw.set_plan(_plan((1, Layout(1, 4))))
    sw.set_plan(None)  # cancelling is always allowed
    assert len(sent) == 1


def test_a_plans_switch_fires_once_and_needs_no_waiter() -> None:
    sw, tickets, sent = _setup(n=3)
    sw.set_plan(_plan((2, Layout(1, 4))))
    sw.fire()
    assert sent == [] and not sw.in_flight  # 3 unfinished: not yet
    sw.table.finalize("r0", FinishLength(8), 1.0)
    sw.fire()
    sw.fire()  # in flight: no second switch
    assert len(sent) == 1 and sw.in_flight
    cmd = sent[0]
    assert isinstance(cmd, m.Reconfigure) and cmd.target == Layout(1, 4)
    assert cmd.reason == "plan: unfinished 2 <= 2"
    event = sw.on_switched(_switched(cmd.ticket, Layout(1, 4)), 2.0)
    assert event.dst == Layout(1, 4) and sw.table.layout == Layout(1, 4)
    assert not sw.in_flight and len(tickets) == 0  # nobody waited: forgotten once answered


def test_a_requested_switch_answers_its_waiter() -> None:
    sw, tickets, _ = _setup()
    ticket = sw.start(Layout(2, 2), "migrate", "requested")
    sw.on_switched(_switched(ticket, Layout(2, 2)), 1.0)
    assert tickets.complete(ticket)
    (event,) = tickets.take(ticket)
    assert isinstance(event, ReconfigEvent) and event.dst == Layout(2, 2)
