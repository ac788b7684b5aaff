"""The driver's bookkeeping, without processes: dispatch, stop strings, triggers, the planner snapshot."""

from __future__ import annotations

import pytest
from rollout_worker.api.plan import Plan, ReconfigEvent, Trigger
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.driver.request_table import RequestTable
from rollout_worker.engine.finish import Finish, FinishAbort, FinishLength, FinishStop
from rollout_worker.engine.messages import StepReport, Switched, TokenOut
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout


def spec(rid: str, max_new: int = 10, min_new: int = 0, prompt: tuple[int, ...] = ()) -> RequestSpec:
    """A request whose prompt is its own unless given (requests with one prompt are dispatched together)."""
    return RequestSpec(rid, prompt or (1, 2, *map(ord, rid)), max_new, Sampling(), min_new_tokens=min_new)


def report(
    replica: int, tokens: list[tuple[str, int]] = (), finished: list[tuple[str, Finish]] = (), **kw: object
) -> StepReport:  # type: ignore[assignment]
    return StepReport(
        replica,
        0,
        0,
        "decode",
        1.0,
        tokens=[TokenOut(r, t) for r, t in tokens],
        finished=list(finished),
        **kw,
    )  # type: ignore[arg-type]


def test_dispatch_balances_and_refuses_duplicates() -> None:
    table = RequestTable(Layout(3, 1))
    for i in range(7):
        table.add(spec(f"r{i}"), (), 0.0)
    placed = table.dispatch()
    assert [d for d, _ in placed] == [0, 1, 2, 0, 1, 2, 0]
    assert table.load() == [3, 2, 2] and table.dispatched == 7
    with pytest.raises(UserError, match="already in flight"):
        table.add(spec("r3"), (), 0.0)


def test_samples_of_one_prompt_go_to_one_replica_within_the_slack() -> None:
    table = RequestTable(Layout(2, 1))
    for i in range(12):  # 12 samples of prompt A, then 2 of prompt B
        table.add(spec(f"a{i}", prompt=(7, 7)), (), 0.0)
    table.add(spec("b0", prompt=(8,)), (), 0.0)
    table.add(spec("b1", prompt=(8,)), (), 0.0)
    placed = [d for d, _ in table.dispatch()]
    # a0 on 0; a1..a7 join it while replica 0 is fewer than 8 busier than replica 1; a8 finds it 8 busier:
    # the least loaded, replica 1; a9..a11 join a8 there; B goes to the least loaded (1), b1 joins b0
    assert placed == [0] * 8 + [1, 1, 1, 1, 1, 1]
    table.finalize("a11", FinishLength(10), 1.0)  # the latest of A gone: the next A goes by load again
    table.finalize("a10", FinishLength(10), 1.0)
    table.add(spec("a12", prompt=(7, 7)), (), 0.0)
    assert [d for d, _ in table.dispatch()] == [1]


def test_tokens_finishes_and_since_step_exactly_once() -> None:
    table = RequestTable(Layout(2, 1))
    table.add(spec("a"), (), 0.0)
    table.add(spec("b"), (), 0.0)
    table.dispatch()
    table.on_step(report(0, [("a", 5)], admitted=("a",)), 1.0)
    s1 = table.snapshot(0, 1.0, [True, True], False, False, "v")
    assert s1.replicas[0].running[0].generated == 1 and s1.finished.lengths == []
    out = table.on_step(report(1, [("b", 7)], [("b", FinishLength(1))]), 2.0)
    assert [u.finish for u in out.updates if u.finish] == [FinishLength(1)]
    s2 = table.snapshot(s1.step, 2.0, [True, True], False, False, "v")
    assert s2.finished.lengths == [1] and s2.finished.capped == [False]
    assert table.snapshot(s2.step, 2.0, [True, True], False, False, "v").finished.lengths == []  # once only
    # a finish the driver decides itself (abort of a queued request) advances the clock as well
    table.add(spec("c"), (), 3.0)
    table.finalize("c", FinishAbort("x"), 3.0, in_report=False)
    assert table.snapshot(s2.step, 3.0, [True, True], False, False, "v").finished.lengths == [0]


def test_stop_string_finishes_at_the_matching_token() -> None:
    table = RequestTable(Layout(1, 1), decode=lambda ids: "".join(chr(65 + i) for i in ids))
    table.add(spec("a", min_new=2), ("CD",), 0.0)
    table.dispatch()
    out = table.on_step(report(0, [("a", 2)]), 1.0)  # "C"
    assert not out.aborts
    out = table.on_step(report(0, [("a", 3)]), 2.0)  # "CD", but min_new_tokens=2 is reached only now
    assert out.aborts == [(0, "a", FinishStop("CD"))]
    assert "a" not in table.reqs
    late = table.on_step(report(0, [("a", 4)]), 3.0)  # the rank had not heard yet: ignored
    assert late.updates == []


def test_a_batch_is_added_whole_or_not_at_all() -> None:
    """Issue 35: an id in flight or given twice refuses the batch before any of it is added."""
    table = RequestTable(Layout(1, 1))
    table.add(spec("a"), (), 0.0)
    for batch, taken in ([spec("b"), spec("a")], "'a' is already in flight"), ([spec("c"), spec("c")], "'c'"):
        with pytest.raises(UserError, match=taken):
            table.add_all([(x, ()) for x in batch], 0.0)
        assert list(table.reqs) == ["a"] and list(table.queued) == ["a"] and table.prompt_tokens == 3
    table.add_all([(spec("b"), ()), (spec("c"), ())], 0.0)
    assert list(table.queued) == ["a", "b", "c"]


def test_a_stop_string_finish_holds_its_id_until_the_replica_lets_go() -> None:
    """Issue 35: after a stop string finished a request, the replica still runs it until it hears of the
    abort; a request of the same id sent meanwhile would get its late tokens and its abort. It is refused
    until the replica reports the request finished."""
    table = RequestTable(Layout(1, 1), decode=lambda ids: "".join(chr(65 + i) for i in ids))
    table.add(spec("a"), ("B",), 0.0)
    table.dispatch()
    assert table.on_step(report(0, [("a", 1)]), 1.0).aborts  # "B": finished here, the rank told
    with pytest.raises(UserError, match="already in flight"):
        table.add(spec("a"), (), 1.0)
    late = table.on_step(report(0, [("a", 2)], [("a", FinishAbort("stopped"))]), 2.0)  # the rank lets go
    assert late.updates == []
    table.add(spec("a"), (), 2.0)  # free again, and untouched by the old request
    assert table.reqs["a"].output == []


def test_min_new_tokens_defers_stop_strings() -> None:
    table = RequestTable(Layout(1, 1), decode=lambda ids: "".join(chr(65 + i) for i in ids))
    table.add(spec("a", min_new=3), ("B",), 0.0)
    table.dispatch()
    assert not table.on_step(report(0, [("a", 1)]), 1.0).aborts  # "B" at token 1 < 3
    assert table.on_step(report(0, [("a", 1)]), 1.0).aborts == []
    assert table.on_step(report(0, [("a", 1)]), 1.0).aborts  # token 3: now it counts


def test_a_stop_string_check_that_fails_aborts_that_request_alone() -> None:
    def decode(ids: list[int]) -> str:
        if 99 in ids:
            raise ValueError("token 99 is not in the tokenizer")
        return "".join(chr(65 + i) for i in ids)

    table = RequestTable(Layout(1, 1), decode=decode)
    table.add(spec("bad"), ("Z",), 0.0)
    table.add(spec("good"), ("Z",), 0.0)
    table.dispatch()
    out = table.on_step(report(0, [("bad", 99), ("good", 1)]), 1.0)
    ((replica, rid, finish),) = out.aborts  # the rank is told to stop it, the driver finished it
    assert (replica, rid) == (0, "bad") and isinstance(finish, FinishAbort)
    assert "ValueError: token 99 is not in the tokenizer" in finish.message
    assert [u.finish for u in out.updates if u.rid == "bad" and u.finish] == [finish]
    assert list(table.reqs) == ["good"] and table.aborted == 1
    out = table.on_step(report(0, [("good", 25)]), 2.0)  # "BZ": the other request carries on
    assert out.aborts == [(0, "good", FinishStop("Z"))]


def test_trigger_fires_once_lowest_reached_first() -> None:
    table = RequestTable(Layout(4, 1))
    for i in range(10):
        table.add(spec(f"r{i}"), (), 0.0)
    table.dispatch()
    trigs = [
        Trigger(unfinished_at_most=8, layout=Layout(2, 2)),
        Trigger(unfinished_at_most=4, layout=Layout(1, 4)),
    ]
    table.set_plan(Plan(based_on_layout=Layout(4, 1), triggers=trigs))
    assert table.fire() is None  # 10 unfinished
    for i in range(7):  # 3 left: both thresholds passed at once -> one switch, straight to 1x4
        table.finalize(f"r{i}", FinishLength(10), 1.0)
    fired = table.fire()
    assert fired is not None and fired.layout == Layout(1, 4) and table.plan is None
    assert table.fire() is None


def test_switch_updates_placements_and_stamps_the_event() -> None:
    table = RequestTable(Layout(2, 1))
    table.add(spec("a"), (), 0.0)
    table.dispatch()
    ev = ReconfigEvent(
        step=0, time_s=0, src=Layout(2, 1), dst=Layout(1, 2), requested="auto", method="migrate", reason="x"
    )
    out = table.on_switched(Switched(1, ev, (("a", 0, True),), 1, 9), 1.5)
    assert out.step == table.step and out.time_s == 1.5 and table.layout == Layout(1, 2)
    assert [p["layout"] for p in table.reqs["a"].placements] == ["2x1", "1x2"]
