"""The planner loop against a real engine server: with a profile in which TP=2 pays in the tail, it pushes a
plan on its own, the engine switches at the step the trigger fires, the decision is recorded with its gain,
cost and outcome, and no token changes. (The pure tick it runs is tested in tests/profiler/planning.)"""

from __future__ import annotations

import asyncio
import threading
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
from rollout_worker.api.sglang import GenerateRequest
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.scheduling.layout import Layout
from rollout_worker.server.convert import to_jobs
from sqlalchemy.orm import Session

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
