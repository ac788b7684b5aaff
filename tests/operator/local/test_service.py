"""Service mode end to end: `rolloutctl run` with `mode: service` starts the pod and the planner loop, and an
external client (as slime does: SGLang's /generate) sends two waves of requests to the engine. The planner
consolidates in the first wave's tail (2x1 -> 1x2) and moves back toward throughput when the second wave
queues (1x2 -> 2x1), with no manual trigger; every output equals a static run's; SIGTERM ends the run with
exit 0 and the decisions and finished lengths in the database."""

from __future__ import annotations

import json
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_profiler.store import database, runs
from sqlalchemy.orm import Session

from tests.operator.local.jobs import job_doc, start_run, write_job
from tests.waiting import wait_until

pytestmark = pytest.mark.multiproc


def _wave(tag: str, lengths: list[int]) -> list[dict[str, Any]]:
    return [
        {
            "rid": f"{tag}-{i}",
            "input_ids": [(7 * i + j) % 500 + 1 for j in range(6 + i % 5)],
            "sampling_params": {
                "max_new_tokens": n,
                "temperature": 0.7,
                "ignore_eos": True,
                "sampling_seed": 1000 + i,
            },
        }
        for i, n in enumerate(lengths)
    ]


WAVE1 = _wave("w1", [12, 18, 24, 30, 15, 20, 1300, 1500])  # a long tail: consolidate
WAVE2 = _wave("w2", [150, 170, 190, 210] * 4)  # 16 at once, 4 per replica at most: they queue on 1x2


class Pod:
    def __init__(self, out: Path) -> None:
        ends = json.loads((out / "endpoints.json").read_text())
        pod = ends["pods"][0]
        key = Path(ends["engine_key_file"]).read_text().strip()
        token = Path(ends["sidecar_token_file"]).read_text().strip()
        self.engine = httpx.Client(
            base_url=pod["engine_url"], headers={"Authorization": f"Bearer {key}"}, timeout=120
        )
        self.sidecar = httpx.Client(
            base_url=pod["sidecar_url"], headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    def send(self, wave: list[dict[str, Any]]) -> dict[str, list[int]]:
        def one(body: dict[str, Any]) -> tuple[str, list[int]]:
            r = self.engine.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return body["rid"], r.json()["output_ids"]

        with ThreadPoolExecutor(len(wave)) as pool:
            return dict(pool.map(one, wave))

    def switches(self) -> list[dict[str, Any]]:
        r = self.sidecar.get("/v1/reconfigurations")
        assert r.status_code == 200, r.text
        return [e for e in r.json() if e["outcome"] == "committed"]


def _serve(tmp: Path, model: Path, policy: str) -> tuple[subprocess.Popen[bytes], Pod, Path]:
    out, log = tmp / policy, tmp / f"{policy}.log"
    doc = job_doc(model, None, out, pods=1, mode="service", engine={"maxBatch": 4})
    job = write_job(tmp / f"{policy}.yaml", doc)
    db = f"sqlite:///{tmp / f'{policy}.db'}"
    runner = start_run(str(job), "--policy", policy, "--db", db, log=log)
    wait_until(
        lambda: "serving until" in log.read_text() or runner.poll() is not None,
        what="the pod to serve",
        timeout=120,
    )
    assert runner.poll() is None, log.read_text()
    return runner, Pod(out), log


def _stop(runner: subprocess.Popen[bytes], log: Path) -> str:
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(60) == 0, log.read_text()
    return log.read_text()


@pytest.mark.long
def test_two_waves_consolidate_then_spread_with_static_outputs(tiny64: Path, tmp_path: Path) -> None:
    runner, pod, log = _serve(tmp_path, tiny64, "adaptive")
    try:
        first = pod.send(WAVE1)
        after_first = pod.switches()
        second = pod.send(WAVE2)
        after_second = pod.switches()
    finally:
        text = _stop(runner, log) if runner.poll() is None else log.read_text()
    assert [(e["src"], e["dst"]) for e in after_first][:1] == [("2x1", "1x2")], text
    back = after_second[len(after_first) :]
    assert ("1x2", "2x1") in [(e["src"], e["dst"]) for e in back], text
    assert all(e["reason"].startswith("plan: unfinished") for e in after_second)  # none by hand
    assert f"{len(WAVE1) + len(WAVE2)} requests served in" in text and "Traceback" not in text

    with Session(database.make_engine(f"sqlite:///{tmp_path / 'adaptive.db'}")) as session:
        decisions = runs.list_decisions(session)
        job = runs.get_job(session, decisions[0].job_id or 0)
        lengths = runs.finished_lengths_for_model(session, job.model_shape_hash)
    planned = [d for d in decisions if d.inputs is not None and d.outcome == "committed"]
    assert {(d.from_layout, d.to_layout) for d in planned} >= {("2x1", "1x2"), ("1x2", "2x1")}
    spread = [d for d in planned if d.to_layout == "2x1"]
    assert all(d.inputs and d.inputs["new_wave"] for d in spread)
    assert all(d.predicted_gain_ms > d.predicted_cost_ms * 1.1 for d in planned)
    assert sorted(x.length for x in lengths) == sorted(len(v) for v in [*first.values(), *second.values()])
    assert job.outcome == "succeeded"

    static, spod, slog = _serve(tmp_path, tiny64, "static")
    try:
        want = {**spod.send(WAVE1), **spod.send(WAVE2)}
        assert spod.switches() == []
    finally:
        if static.poll() is None:
            _stop(static, slog)
    assert {**first, **second} == want
