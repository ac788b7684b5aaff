"""The planner loop against a real engine server: with a profile in which TP=2 pays in the tail, it pushes a
plan on its own, the engine switches at the step the trigger fires, the decision is recorded with its gain,
cost and outcome, and no token changes. (The pure tick it runs is tested in tests/profiler/planning.)"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rollout_operator.control.links import EngineLink
from rollout_operator.control.planner_loop import PlannerLoop
from rollout_operator.control.records import DbRecorder
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.profile import Profile
from rollout_profiler.store import database, migrate, runs
from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.sglang import GenerateRequest
from rollout_worker.api.state import EngineState
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.scheduling.layout import Layout
from rollout_worker.server.convert import to_jobs
from sqlalchemy.orm import Session

from tests.profiler.planning.test_tick import _state
from tests.worker.server.served import start

PROFILE = Path(__file__).parents[2] / "data" / "tiny-2rank-tp2-pays.json"
POLICY = PlannerPolicy(candidates=(Layout(2, 1), Layout(1, 2)), margin=0.1, min_gain_ms=5.0)


def _bodies() -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    lens = [int(x) for x in rng.integers(15, 40, 10)] + [260, 330]
    return [
        {
            "input_ids": [int(t) for t in rng.integers(0, 512, 6)],
            "rid": f"t{i}",
            "sampling_params": {
                "max_new_tokens": n,
                "ignore_eos": True,
                "temperature": 0.8 if i % 2 else 0,
                "sampling_seed": i,
            },
        }
        for i, n in enumerate(lens)
    ]


def test_loop_switches_honestly_and_records_it(tiny32: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rollout.db'}"
    migrate.upgrade(url)
    db = database.make_engine(url)
    with Session(db) as session, session.begin():
        job = runs.record_job(
            session, name="loop", namespace="test", spec_hash="x", model_shape_hash="7fd6f34429fc31ba"
        )
    server = start(tiny32, tmp_path, "--ranks", "2")
    results: dict[str, Any] = {}
    bodies = _bodies()

    def post(body: dict[str, Any]) -> None:
        results[body["rid"]] = server.post("/generate", body, timeout=120).json()

    threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
    link = EngineLink("pod-0", server.url)
    loop = PlannerLoop([link], LatencyModel(Profile.from_json(PROFILE)), POLICY, None, DbRecorder(db, job))

    async def drive() -> None:  # as the runner and the operator do: a tick, then the next one
        while any(t.is_alive() for t in threads):
            await loop.run_once()
            await asyncio.sleep(0.05)
        await loop.run_once()  # records the switches that ran since the last tick

    try:
        for t in threads:
            t.start()
        asyncio.run(drive())
    finally:
        server.stop()
    with Session(db) as session:
        decisions = runs.list_decisions(session, job)
    switched = [d for d in decisions if (d.from_layout, d.to_layout) == ("2x1", "1x2")]
    # a tick may land while the first prompts are still arriving and push a switch that the full batch then
    # takes back before it fires: that decision is superseded, and a later one switches
    assert [d.outcome for d in switched if d.outcome != "superseded"][:1] == ["committed"], decisions
    d = next(d for d in switched if d.outcome == "committed")
    assert d.outcome == "committed" and d.step is not None and d.actual_cost_ms is not None
    assert d.predicted_gain_ms > d.predicted_cost_ms * (1 + POLICY.margin) + POLICY.min_gain_ms
    assert d.inputs is not None and d.inputs["layout"] == "2x1"
    specs = [j.spec for b in bodies for j in to_jobs(GenerateRequest.model_validate(b), None)]
    static = run_batch(EngineConfig.load(str(tiny32), 2), specs)
    assert {o["id"]: o["output_ids"] for o in static.outputs} == {
        k: v["output_ids"] for k, v in results.items()
    }
    assert any(
        "1x2" in v["meta_info"]["layouts"] and "2x1" in v["meta_info"]["layouts"] for v in results.values()
    )


@dataclass
class _Link:
    """A pod whose engine states come from a list; it holds what is pushed and reports no switch."""

    states: list[EngineState]
    name: str = "pod-0"
    pushed: list[Plan] = field(default_factory=list)

    async def state(self, since_step: int) -> tuple[EngineState, int]:
        held = self.pushed[-1] if self.pushed else None
        return self.states.pop(0).model_copy(update={"plan": held}), 0

    async def push(self, plan: Plan) -> bool:
        self.pushed.append(plan)
        return True

    async def events(self) -> list[ReconfigEvent]:
        return []


@dataclass
class _Recorder:
    calls: list[tuple[str, int | None]] = field(default_factory=list)

    def decided(self, pod: str, result: Any) -> int:
        self.calls.append(("decided", len(self.calls) + 1))
        return len(self.calls)

    def switched(self, pod: str, decision_id: int | None, event: ReconfigEvent) -> None:
        self.calls.append(("switched", decision_id))

    def superseded(self, decision_id: int) -> None:
        self.calls.append(("superseded", decision_id))

    def lengths(self, lengths: list[int], capped: list[bool]) -> None: ...


def test_a_switch_taken_back_before_it_fired_is_recorded_superseded() -> None:
    """A switch decision pushed on a lone long request (the first prompt of a batch to arrive) and replaced
    on the next tick by the refreshed plan of the full batch never runs: its record says superseded, where
    it stayed ``pushed`` for good."""
    link = _Link([_state([300]), _state([1] * 16)])
    recorder = _Recorder()
    loop = PlannerLoop([link], LatencyModel(Profile.from_json(PROFILE)), POLICY, None, recorder)
    loop.memory["pod-0"].lengths += [20, 22, 25, 30, 31, 33, 35, 40]
    loop.memory["pod-0"].capped += [False] * 8
    first = asyncio.run(loop.run_once())
    assert first[0].pushed and first[0].result.decision.action == "switch"
    second = asyncio.run(loop.run_once())
    assert second[0].result.decision.action == "keep" and not second[0].pushed
    assert len(link.pushed) == 2 and link.pushed[1] != link.pushed[0]  # the held plan refreshed
    assert recorder.calls == [("decided", 1), ("superseded", 1)]
    assert loop.pending["pod-0"] == [None]  # the refreshed trigger: no decision of its own
