"""``apply_ticks``: what a planner tick writes into the job's status (pods' steps, tokens and switch counts,
the last decisions, matched to the switches that ran) and the Events it posts. Pure: tables, no processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from rollout_operator.api.status import LAST_DECISIONS, DecisionRecord, PodProgress, RolloutJobStatus
from rollout_operator.cluster.decisions import PodTick, apply_ticks
from rollout_operator.control.planner_loop import Outcome
from rollout_profiler.planning.planner import Decision
from rollout_profiler.planning.tick import TickResult
from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.scheduling.layout import Layout

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def _switch(dst: str, src: str = "2x1", ok: bool = True, step: int = 40, **kw: Any) -> ReconfigEvent:
    base: dict[str, Any] = {
        "step": step,
        "time_s": 1.0,
        "src": src,
        "dst": dst,
        "requested": "auto",
        "method": "migrate",
        "reason": "plan: unfinished <= 4",
        "predicted_ms": 30.0,
        "actual_ms": 25.0,
    }
    if not ok:
        base |= {"outcome": "rolled_back", "error": "rank 1: out of memory"}
    return ReconfigEvent.model_validate(base | kw)


def _decision(target: str, gain: float = 120.4567, cost: float = 30.1234) -> TickResult:
    d = Decision("switch", Layout.parse(target), "migrate", gain, cost, "unfinished <= 4")
    return TickResult(d, None, {"layout": "2x1"})


def _tick(
    pod: str, step: int = 50, tokens: int = 0, events: tuple[ReconfigEvent, ...] = (), push: str | None = None
) -> PodTick:
    result = _decision(push) if push is not None else _decision("2x1")
    return PodTick(Outcome(pod, result, push is not None, list(events)), step, tokens)


def _record(pod: str, to: str, actual: float | None = None, step: int | None = None) -> DecisionRecord:
    return DecisionRecord(
        time="2025-01-01T00:00:00Z",
        pod=pod,
        from_layout="2x1",
        to_layout=to,
        method="auto",
        reason="planned",
        predicted_gain_ms=100.0,
        predicted_cost_ms=20.0,
        actual_cost_ms=actual,
        step=step,
    )


def _status(*decisions: DecisionRecord, reconfigurations: int = 0) -> RolloutJobStatus:
    pods = [PodProgress(index=i, name=f"job-{i}", step=10, tokens=1000, reconfigurations=1) for i in (0, 1)]
    return RolloutJobStatus(pods=pods, reconfigurations=reconfigurations, last_decisions=list(decisions))


# a decision as a row: (pod, from, to, method, gain, cost, actual, step, time)
Row = tuple[str, str, str, str, float, float, float | None, int | None, str]
PLANNED: Row = ("job-0", "2x1", "1x2", "auto", 100.0, 20.0, None, None, "2025-01-01T00:00:00Z")


def _row(d: DecisionRecord) -> Row:
    return (
        d.pod,
        d.from_layout,
        d.to_layout,
        d.method,
        d.predicted_gain_ms,
        d.predicted_cost_ms,
        d.actual_cost_ms,
        d.step,
        d.time,
    )


@dataclass
class Case:
    before: RolloutJobStatus
    ticks: list[PodTick]
    pods: list[tuple[int, int, int]]  # each pod's (step, tokens, reconfigurations) after
    reconfigurations: int
    decisions: list[Row]
    events: list[tuple[str, str]] = field(default_factory=list)  # (type, reason)


CASES: dict[str, Case] = {
    "no ticks: nothing changes": Case(_status(), [], [(10, 1000, 1), (10, 1000, 1)], 0, []),
    "progress: the engine's step, tokens added": Case(
        _status(), [_tick("job-1", step=77, tokens=300)], [(10, 1000, 1), (77, 1300, 1)], 0, []
    ),
    "a pod the status does not list is ignored": Case(
        _status(), [_tick("job-9", events=(_switch("1x2"),), push="1x2")], [(10, 1000, 1)] * 2, 0, []
    ),
    "a pushed plan is a decision without a cost yet": Case(
        _status(),
        [_tick("job-0", push="1x2")],
        [(50, 1000, 1), (10, 1000, 1)],
        0,
        [("job-0", "2x1", "1x2", "migrate", 120.457, 30.123, None, None, "2025-01-02T03:04:05Z")],
        [("Normal", "ReconfigurationPlanned")],
    ),
    "the switch a decision planned completes it": Case(
        _status(_record("job-0", "1x2")),
        [_tick("job-0", events=(_switch("1x2"),))],
        [(50, 1000, 2), (10, 1000, 1)],
        1,
        [("job-0", "2x1", "1x2", "migrate", 100.0, 20.0, 25.0, 40, "2025-01-01T00:00:00Z")],
        [("Normal", "Reconfigured")],
    ),
    "a switch no decision planned (a chain's later trigger) is recorded as it ran": Case(
        _status(_record("job-0", "1x2", actual=10.0, step=5), _record("job-1", "1x2")),
        [_tick("job-0", events=(_switch("1x2"),))],
        [(50, 1000, 2), (10, 1000, 1)],
        1,
        [
            ("job-0", "2x1", "1x2", "auto", 100.0, 20.0, 10.0, 5, "2025-01-01T00:00:00Z"),
            ("job-1", *PLANNED[1:]),
            ("job-0", "2x1", "1x2", "migrate", 0.0, 30.0, 25.0, 40, "2025-01-02T03:04:05Z"),
        ],
        [("Normal", "Reconfigured")],
    ),
    "the newest open decision of the pod for that layout is the one completed": Case(
        _status(_record("job-0", "1x2"), _record("job-0", "4x1"), _record("job-0", "1x2")),
        [_tick("job-0", events=(_switch("1x2"),))],
        [(50, 1000, 2), (10, 1000, 1)],
        1,
        [
            PLANNED,
            ("job-0", "2x1", "4x1", *PLANNED[3:]),
            ("job-0", "2x1", "1x2", "migrate", 100.0, 20.0, 25.0, 40, "2025-01-01T00:00:00Z"),
        ],
        [("Normal", "Reconfigured")],
    ),
    "a rolled-back switch is a warning and completes no decision": Case(
        _status(_record("job-0", "1x2"), reconfigurations=3),
        [_tick("job-0", events=(_switch("1x2", ok=False),))],
        [(50, 1000, 2), (10, 1000, 1)],  # the pod counts the engine's events: a new operator skips as many
        3,
        [PLANNED],
        [("Warning", "ReconfigurationRolledBack")],
    ),
    "switches, then the plan pushed in the same tick": Case(
        _status(_record("job-1", "1x2")),
        [
            _tick("job-0", step=60, tokens=5),
            _tick("job-1", step=70, events=(_switch("1x2"), _switch("2x1", src="1x2", step=45)), push="1x2"),
        ],
        [(60, 1005, 1), (70, 1000, 3)],
        2,
        [
            ("job-1", "2x1", "1x2", "migrate", 100.0, 20.0, 25.0, 40, "2025-01-01T00:00:00Z"),
            ("job-1", "1x2", "2x1", "migrate", 0.0, 30.0, 25.0, 45, "2025-01-02T03:04:05Z"),
            ("job-1", "2x1", "1x2", "migrate", 120.457, 30.123, None, None, "2025-01-02T03:04:05Z"),
        ],
        [("Normal", "Reconfigured"), ("Normal", "Reconfigured"), ("Normal", "ReconfigurationPlanned")],
    ),
    "only the last decisions are kept": Case(
        _status(*[_record("job-0", "1x2", actual=float(i), step=i) for i in range(LAST_DECISIONS)]),
        [_tick("job-0", push="1x2")],
        [(50, 1000, 1), (10, 1000, 1)],
        0,
        [
            *[(*PLANNED[:6], float(i), i, PLANNED[8]) for i in range(1, LAST_DECISIONS)],
            ("job-0", "2x1", "1x2", "migrate", 120.457, 30.123, None, None, "2025-01-02T03:04:05Z"),
        ],
        [("Normal", "ReconfigurationPlanned")],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_apply_ticks(name: str) -> None:
    case = CASES[name]
    st = case.before.model_copy(deep=True)
    events = apply_ticks(st, case.ticks, NOW)
    assert [(p.step, p.tokens, p.reconfigurations) for p in st.pods] == case.pods
    assert st.reconfigurations == case.reconfigurations
    assert [_row(d) for d in st.last_decisions] == case.decisions
    assert [(e.type, e.reason) for e in events] == case.events


def test_the_events_say_what_switched_where_and_at_what_cost() -> None:
    st = _status(_record("job-0", "1x2"))
    ticks = [
        _tick("job-0", events=(_switch("1x2"), _switch("2x1", src="1x2", ok=False))),
        _tick("job-1", events=(_switch("1x2", actual_ms=None),), push="1x2"),
    ]
    assert [e.message for e in apply_ticks(st, ticks, NOW)] == [
        "job-0: 2x1 -> 1x2 at step 40 (migrate; predicted 30 ms, took 25 ms)",
        "job-0: 1x2 -> 2x1 rolled back (rank 1: out of memory)",
        "job-1: 2x1 -> 1x2 at step 40 (migrate; predicted 30 ms, took ? ms)",
        "job-1: 2x1 -> 1x2 (gain 120 ms > cost 30 ms)",
    ]
