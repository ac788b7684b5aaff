"""``JobRuntime._relink``: the operator's links follow the job's pods. A running pod with an address keeps
its link; the same pod at a new address gets a new link and keeps the planner's memory of its engine; a new
pod (new uid) gets a new link and a fresh memory of its engine, keeping the job's finished lengths. A pod
not running, without an address or being deleted changes nothing. Tables, no processes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from rollout_operator.api.status import PodProgress, RolloutJobStatus
from rollout_operator.cluster.reconcile import PodView
from rollout_operator.kube.runtime import JobRuntime
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.profile import Profile
from rollout_worker.scheduling.layout import Layout

from tests.operator.local.jobs import PROFILE

POLICY = PlannerPolicy(candidates=(Layout(2, 1), Layout(1, 2)))
OLD = "http://10.0.0.1:8080"


def _runtime(planner: bool) -> JobRuntime:
    """As after an operator restart: pod 0 (uid a, at 10.0.0.1) at engine step 70 after 2 switches, with a
    plan pushed (decision 7) whose switch has not been seen yet, and 2 finished lengths."""
    pod = PodProgress(index=0, name="job-0", uid="a", ip="10.0.0.1", step=70, reconfigurations=2)
    model = LatencyModel(Profile.from_json(PROFILE)) if planner else None
    rt = JobRuntime.start("token", RolloutJobStatus(pods=[pod]), model, POLICY, None, None, 2.0)
    if rt.loop is not None:
        rt.loop.memory["job-0"].lengths += [30, 1500]
        rt.loop.memory["job-0"].capped += [False, True]
        rt.loop.pending["job-0"] = [7]
    rt.awaiting_switch.add("job-0")
    return rt


def _view(index: int, uid: str, ip: str | None, phase: str = "Running", deleting: bool = False) -> PodView:
    return PodView(index, f"job-{index}", uid, phase, ip, ready=phase == "Running", deleting=deleting)


@dataclass
class Case:
    pods: list[PodView]
    links: dict[int, tuple[str, str]]  # index -> (uid, API URL) after
    kept: bool  # pod 0's link is the one it had (else the old one is closed)
    memory: dict[str, tuple[int, int, list[int]]]  # pod -> (since_step, events_seen, lengths)
    pending: dict[str, list[int | None]]
    awaiting: set[str]


KEPT = {"job-0": (70, 2, [30, 1500])}
FRESH = {"job-0": (0, 0, [30, 1500])}
CASES: dict[str, Case] = {
    "the same pod at the same address: nothing changes": Case(
        [_view(0, "a", "10.0.0.1")], {0: ("a", OLD)}, True, KEPT, {"job-0": [7]}, {"job-0"}
    ),
    "the same pod at a new address: a new link, the same engine": Case(
        [_view(0, "a", "10.0.0.9")], {0: ("a", "http://10.0.0.9:8080")}, False, KEPT, {"job-0": [7]}, set()
    ),
    "a new pod: a new link, a fresh engine memory, the job's lengths kept": Case(
        [_view(0, "b", "10.0.0.9")], {0: ("b", "http://10.0.0.9:8080")}, False, FRESH, {"job-0": []}, set()
    ),
    "a new pod at the old address: still a new engine": Case(
        [_view(0, "b", "10.0.0.1")], {0: ("b", OLD)}, False, FRESH, {"job-0": []}, set()
    ),
    "a new pod not yet running: not yet": Case(
        [_view(0, "b", "10.0.0.9", phase="Pending")], {0: ("a", OLD)}, True, KEPT, {"job-0": [7]}, {"job-0"}
    ),
    "a new pod without an address: not yet": Case(
        [_view(0, "b", None)], {0: ("a", OLD)}, True, KEPT, {"job-0": [7]}, {"job-0"}
    ),
    "a pod being deleted: left alone": Case(
        [_view(0, "b", "10.0.0.9", deleting=True)], {0: ("a", OLD)}, True, KEPT, {"job-0": [7]}, {"job-0"}
    ),
    "a pod of another index: its own link and memory": Case(
        [_view(1, "c", "10.0.0.2")],
        {0: ("a", OLD), 1: ("c", "http://10.0.0.2:8080")},
        True,
        {**KEPT, "job-1": (0, 0, [])},
        {"job-0": [7], "job-1": []},
        {"job-0"},
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_relink(name: str) -> None:
    case = CASES[name]
    rt = _runtime(planner=True)
    old = rt.links[0][1]
    asyncio.run(rt._relink({p.index: p for p in case.pods}))
    assert {i: (uid, link.api) for i, (uid, link) in rt.links.items()} == case.links
    assert (rt.links[0][1] is old, old.client.is_closed) == (case.kept, not case.kept)
    assert rt.loop is not None
    got = {name: (m.since_step, m.events_seen, m.lengths) for name, m in rt.loop.memory.items()}
    assert got == case.memory
    assert rt.loop.pending == case.pending
    assert rt.awaiting_switch == case.awaiting


def test_relink_without_a_planner_only_moves_links() -> None:
    rt = _runtime(planner=False)
    asyncio.run(rt._relink({0: _view(0, "b", "10.0.0.9")}))
    assert rt.loop is None and rt.links[0][0] == "b" and rt.links[0][1].admin == "http://10.0.0.9:8081"
