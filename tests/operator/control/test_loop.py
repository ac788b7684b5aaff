"""The planner loop against a real engine server: with a profile in which TP=2 pays in the tail, it pushes a
plan on its own, the engine switches at the step the trigger fires, the decision is recorded with its gain,
cost and outcome, and no token changes."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
from rollout_operator.control.links import EngineLink
from rollout_operator.control.loop import PlannerLoop
from rollout_operator.control.records import DbRecorder
from rollout_operator.control.tick import PodMemory, snapshot, tick
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import PlannerPolicy
from rollout_profiler.profile import Profile
from rollout_profiler.store import engine as db_engine
from rollout_profiler.store import migrate, runs
from rollout_worker.api.layout import Layout
from rollout_worker.api.sglang import GenerateRequest
from rollout_worker.api.state import (
    EngineState,
    FinishedLengths,
    ReplicaRequests,
    RunningRequest,
    WaitingRequest,
)
from rollout_worker.engine.batch import run_batch
from rollout_worker.engine.config import EngineConfig
from rollout_worker.server.convert import to_jobs
from sqlalchemy.orm import Session

from tests.worker.server.served import start

PROFILE = Path(__file__).parents[2] / "data" / "tiny-2rank-tp2-pays.json"
POLICY = PlannerPolicy(candidates=(Layout(2, 1), Layout(1, 2)), margin=0.1, min_gain_ms=5.0)


def _state(running: list[int], waiting: int = 0, layout: Layout = Layout(2, 1)) -> EngineState:
    reps = [ReplicaRequests() for _ in range(layout.replicas)]
    for i, g in enumerate(running):
        reps[i % layout.replicas].running.append(
            RunningRequest(rid=f"r{i}", prompt_len=8, generated=g, max_new_tokens=400)
        )
    for i in range(waiting):
        reps[0].waiting.append(WaitingRequest(rid=f"w{i}", prompt_len=20, max_new_tokens=50))
    return EngineState(
        layout=layout,
        step=10,
        time_s=1.0,
        ranks_ready=[True, True],
        paused=False,
        reconfiguring=False,
        replicas=reps,
        finished=FinishedLengths(since_step=0),
        weight_version="v",
        reconfigurations=0,
    )


def test_snapshot_and_tick_are_pure() -> None:
    snap = snapshot(_state([5, 6, 7], waiting=2), not_submitted=3)
    assert [len(r.generated) for r in snap.replicas] == [2, 1]
    assert [r.waiting for r in snap.replicas] == [2 + 2, 1]  # engine waiting + 3 not submitted, dealt
    assert snap.waiting_prompt_len == 20 and snap.waiting_cap == 50
    model = LatencyModel(Profile.from_json(PROFILE))
    mem = PodMemory(lengths=[20, 22, 25, 30, 31, 33, 35, 40], capped=[False] * 8)
    tail = tick(_state([300]), mem, model, POLICY, None)  # one long request left: consolidate
    assert tail.decision.action == "switch" and tail.plan is not None
    assert tail.plan.based_on_layout == Layout(2, 1) and tail.plan.triggers[0].layout == Layout(1, 2)
    assert tail.decision.predicted_gain_ms > tail.decision.predicted_cost_ms * 1.1
    busy = tick(_state([1] * 16), PodMemory(), model, POLICY, None)  # a full batch: keep 2x1
    assert busy.decision.action == "keep" and busy.plan is None


def test_a_new_wave_moves_a_consolidated_pod_back_toward_throughput() -> None:
    model = LatencyModel(Profile.from_json(PROFILE))
    one = Layout(1, 2)
    # consolidated, a few requests running: shrinking is not considered
    quiet = tick(_state([40, 50], layout=one), PodMemory(), model, POLICY, None)
    assert quiet.plan is None and not quiet.inputs["new_wave"]
    # a wave queues behind them: back to 2x1
    wave = tick(_state([40, 50], waiting=14, layout=one), PodMemory(), model, POLICY, None)
    assert wave.inputs["new_wave"] and wave.plan is not None
    assert wave.plan.triggers[0].layout == Layout(2, 1)
    # new weights (the next RL iteration): the first requests may move it back before any queue forms
    mem = PodMemory()
    first = _state([1] * 8, layout=one)
    mem.absorb(first)
    assert tick(first, mem, model, POLICY, None).plan is None  # same weights: no shrink
    updated = first.model_copy(update={"weight_version": "v2"})
    mem.absorb(updated)
    moved = tick(updated, mem, model, POLICY, None)
    assert moved.inputs["new_wave"] and moved.plan is not None
    assert moved.plan.triggers[0].layout == Layout(2, 1)


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
    db = db_engine.make_engine(url)
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
    assert switched, decisions
    d = switched[0]
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
