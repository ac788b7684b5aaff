"""Service mode, the sidecar's side: an external client sends SGLang requests straight to the engine; the
sidecar's progress and state reflect them, a plan PUT through its admin port reaches the engine, and once
the engine is gone for longer than allowed the sidecar exits 1 with one line."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_worker.api.sidecar import Progress, SidecarState

from tests.waiting import wait_until
from tests.worker.server.served import Served
from tests.worker.sidecar.proc import SidecarProc, sidecar_env, start_sidecar

pytestmark = pytest.mark.multiproc
N = 6


@pytest.fixture(scope="module")
def sidecar(engine: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProc]:
    tmp = tmp_path_factory.mktemp("service")
    side = start_sidecar(
        sidecar_env(engine, tmp, mode="service", engine_timeout_seconds=1.0), tmp / "side.log"
    )
    yield side
    if side.proc.poll() is None:
        side.stop()


def engine_call(engine: Served, method: str, path: str, body: Any = None) -> Any:
    r = httpx.request(method, engine.url + path, headers=engine.headers, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def progress(side: SidecarProc) -> Progress:
    return Progress.model_validate(side.json("/v1/progress"))


def test_external_requests_show_in_progress_and_state(sidecar: SidecarProc, engine: Served) -> None:
    before = progress(sidecar)
    assert before.mode == "service" and before.samples_total is None and not before.done
    assert sidecar.get("/v1/samples").status_code == 404  # samples go to the client that asked
    step = engine_call(engine, "GET", "/v1/state")["step"]
    engine_call(engine, "POST", "/pause_generation", {"mode": "in_place"})  # hold them, to look at them
    answers: list[Any] = []
    body = {
        "input_ids": [[5 + i, 6, 7] for i in range(N)],
        "rid": [f"ext-{i}" for i in range(N)],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    client = threading.Thread(target=lambda: answers.append(engine_call(engine, "POST", "/generate", body)))
    client.start()
    try:
        held = wait_until(lambda: (p := progress(sidecar)).waiting == N and p, what="the external requests")
        assert held.running == 0 and held.in_flight == 0 and held.not_submitted == 0
        state = SidecarState.model_validate(sidecar.json("/v1/state", params={"since_step": step}))
        assert sorted(q.rid for q in state.engine.queued) == sorted(body["rid"])
        assert state.not_submitted.samples == 0 and state.engine.finished.since_step == step
    finally:
        engine_call(engine, "POST", "/continue_generation", {})
        client.join(60)
    assert [len(a["output_ids"]) for a in answers[0]] == [8] * N
    done = wait_until(
        lambda: (p := progress(sidecar)).samples_done >= before.samples_done + N and p, what="done"
    )
    assert done.running == done.waiting == 0
    state = SidecarState.model_validate(sidecar.json("/v1/state", params={"since_step": step}))
    assert sorted(state.engine.finished.lengths) == [8] * N  # exactly the external requests, since `step`


def test_a_plan_through_the_admin_port_reaches_the_engine(sidecar: SidecarProc, engine: Served) -> None:
    layout = engine_call(engine, "GET", "/v1/state")["layout"]
    other = "1x2" if layout == "2x1" else "2x1"
    plan = {"based_on_layout": layout, "triggers": [{"unfinished_at_most": 0, "layout": other}]}
    r = sidecar.admin_call("PUT", "/v1/plan", plan)
    assert r.status_code == 200, r.text
    wait_until(lambda: engine_call(engine, "GET", "/get_server_info")["layout"] == other, what="the switch")
    event = engine_call(engine, "GET", "/v1/reconfigurations")[-1]
    assert (event["src"], event["dst"]) == (layout, other) and event["reason"].startswith("plan")
    seen = wait_until(lambda: (p := progress(sidecar)).layout == other and p, what="the sidecar to see it")
    assert seen.reconfigurations >= 1
    assert sidecar.json("/v1/reconfigurations") == engine_call(engine, "GET", "/v1/reconfigurations")
    back = sidecar.admin_call("POST", "/v1/reconfigure", {"layout": layout})
    assert back.status_code == 200 and back.json()["event"]["dst"] == layout


def test_the_sidecar_exits_1_once_the_engine_is_gone_too_long(sidecar: SidecarProc, engine: Served) -> None:
    engine.stop()
    code = sidecar.wait(30)
    log = Path(sidecar.log).read_text().strip().splitlines()
    assert code == 1 and log[-1].startswith(f"error: engine at {engine.url} unreachable or unhealthy for 1 s")
    assert "Traceback" not in "\n".join(log)
