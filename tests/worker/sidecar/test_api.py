"""The sidecar's HTTP API on a real process: the token on every protected route of both ports (walked from
the OpenAPI), open health and metrics, 422 naming the field, 413, admin routes only on the admin port, the
engine's answers passed through, schemathesis (bounded examples, no 5xx, 4xx in the error schema), signals
and exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_worker.proc import free_port

from tests.waiting import wait_until
from tests.worker.server.served import Served, alive, descendants
from tests.worker.sidecar.proc import SidecarProc, sidecar_env, start_sidecar
from tests.worker.web.fuzz import fuzz

pytestmark = pytest.mark.multiproc
OPEN = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")}
API_ROUTES = OPEN | {("GET", f"/v1/{x}") for x in ("progress", "state", "samples", "reconfigurations")}
ADMIN_ROUTES = {("PUT", "/v1/plan"), ("POST", "/v1/reconfigure")}
BODY_LIMIT = 4096
E = "ROLLOUT_SIDECAR_"


@pytest.fixture(scope="module")
def sidecar(
    engine: Served, tiny64: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SidecarProc]:
    tmp = tmp_path_factory.mktemp("api")
    env = sidecar_env(
        engine,
        tmp,
        prompts_path=prompts,
        model_dir=tiny64,
        output_dir=tmp / "out",
        max_new_tokens=8,
        max_body_bytes=BODY_LIMIT,
    )
    side = start_sidecar(env, tmp / "sidecar.log")
    assert descendants(side.proc.pid) == []  # the sidecar starts no process
    yield side
    assert side.stop() == 0, side.tail()  # SIGTERM: both servers stop, the file is closed, exit 0


def operations(base: str, headers: dict[str, str]) -> set[tuple[str, str]]:
    spec = httpx.get(base + "/openapi.json", headers=headers, timeout=30).json()
    return {(m.upper(), path) for path, item in spec["paths"].items() for m in item}


def test_every_protected_route_of_both_ports_needs_the_token(sidecar: SidecarProc) -> None:
    api, admin = operations(sidecar.api, sidecar.headers), operations(sidecar.admin, sidecar.headers)
    assert api == API_ROUTES and admin == ADMIN_ROUTES
    checks = [(sidecar.api, m, p) for m, p in api - OPEN] + [(sidecar.admin, m, p) for m, p in admin]
    for base in (sidecar.api, sidecar.admin):  # the schema and the docs need it too
        checks += [(base, "GET", "/openapi.json"), (base, "GET", "/docs")]
    for base, method, path in checks:
        none = httpx.request(method, base + path, timeout=30)
        assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer", (method, path)
        for auth in ("Bearer wrong-token", "Bearer " + sidecar.token + "x"):
            wrong = httpx.request(method, base + path, headers={"Authorization": auth}, timeout=30)
            assert wrong.status_code == 403, (method, path, wrong.text)
        basic = httpx.request(
            method, base + path, headers={"Authorization": "Basic " + sidecar.token}, timeout=30
        )
        assert basic.status_code == 401, (method, path)
    for method, path in OPEN:
        assert httpx.request(method, sidecar.api + path, timeout=30).status_code == 200, path
    assert "elastic_rollout_sidecar_samples_done" in httpx.get(sidecar.api + "/metrics").text


def test_admin_routes_only_on_the_admin_port(sidecar: SidecarProc) -> None:
    for method, path in ADMIN_ROUTES:
        r = httpx.request(method, sidecar.api + path, headers=sidecar.headers, json={"layout": "2x1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, (method, path)
    for method, path in API_ROUTES - OPEN:
        r = httpx.request(method, sidecar.admin + path, headers=sidecar.headers)
        assert r.status_code == 404, (method, path)


OK = {"unfinished_at_most": 4, "layout": "1x2"}
PLAN, RECONF = ("admin", "PUT", "/v1/plan"), ("admin", "POST", "/v1/reconfigure")


def plan(*triggers: dict[str, Any]) -> dict[str, Any]:
    return {"based_on_layout": "2x1", "triggers": list(triggers)}


@pytest.mark.parametrize(
    ("port", "method", "path", "body", "field"),
    [
        (*PLAN, plan({"unfinished_at_most": 3, "layout": "0x2"}), "triggers.0.layout"),
        (*PLAN, plan(OK, {**OK, "unfinished_at_most": -1}), "triggers.1.unfinished_at_most"),
        (*PLAN, {"triggers": []}, "based_on_layout"),
        (*PLAN, {"based_on_layout": "2x1", "force": True}, "force"),
        (*PLAN, [1, 2], "body"),
        (*RECONF, {"layout": "1x2", "method": "teleport"}, "method"),
        (*RECONF, {"layout": "2by1"}, "layout"),
        (*RECONF, b"{not json", "body"),
        ("api", "GET", "/v1/state?since_step=-1", None, "since_step"),
        ("api", "GET", "/v1/samples?limit=0", None, "limit"),
        ("api", "GET", "/v1/samples?after=first", None, "after"),
    ],
)  # fmt: skip
def test_invalid_input_is_422_naming_the_field(
    sidecar: SidecarProc, port: str, method: str, path: str, body: Any, field: str
) -> None:
    base = sidecar.admin if port == "admin" else sidecar.api
    kw: dict[str, Any] = {"content": body, "headers": {**sidecar.headers, "Content-Type": "application/json"}}
    if not isinstance(body, bytes):
        kw = {"json": body, "headers": sidecar.headers}
    r = httpx.request(method, base + path, timeout=30, **kw)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"].startswith(f"{field}: ") and err["code"] == 422


def test_bodies_over_the_limit_are_413(sidecar: SidecarProc) -> None:
    big = {"based_on_layout": "2x1", "triggers": [], "pad": "x" * BODY_LIMIT}
    r = httpx.put(sidecar.admin + "/v1/plan", headers=sidecar.headers, json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"layout": "'
        for _ in range(BODY_LIMIT // 64 + 1):
            yield b"x" * 64
        yield b'"}'

    headers = {**sidecar.headers, "Content-Type": "application/json"}
    r = httpx.post(sidecar.admin + "/v1/reconfigure", headers=headers, content=chunks(), timeout=30)
    assert r.status_code == 413


def test_the_engines_answers_pass_through(sidecar: SidecarProc, engine: Served) -> None:
    layout = httpx.get(engine.url + "/v1/state", headers=engine.headers).json()["layout"]
    stale = "1x2" if layout == "2x1" else "2x1"
    plan = {"based_on_layout": stale, "triggers": [{"unfinished_at_most": 0, "layout": layout}]}
    r = sidecar.admin_call("PUT", "/v1/plan", plan)
    direct = httpx.put(engine.url + "/v1/plan", headers=engine.headers, json=plan)
    assert r.status_code == direct.status_code == 409 and r.json() == direct.json()
    r = sidecar.admin_call("POST", "/v1/reconfigure", {"layout": "3x1"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "layout"
    assert "not among the candidate layouts" in r.json()["error"]["message"]
    r = sidecar.admin_call("POST", "/v1/reconfigure", {"layout": layout})
    assert r.status_code == 200 and r.json()["message"] == f"already in {layout}"


def test_schemathesis_finds_no_5xx_on_either_port(sidecar: SidecarProc) -> None:
    assert fuzz(sidecar.api, sidecar.headers) == len(API_ROUTES)
    assert fuzz(sidecar.admin, sidecar.headers) == len(ADMIN_ROUTES)


def _sidecar_cli(env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_SIDECAR_")}
    return subprocess.run(
        [sys.executable, "-m", "rollout_operator.cli.main", "sidecar"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_an_unreachable_engine_ends_the_sidecar_with_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    env = sidecar_env(
        None, tmp_path, mode="service", engine_url=f"http://127.0.0.1:{port}", engine_wait_seconds=1
    )
    env |= {"ROLLOUT_SIDECAR_PORT": str(free_port()), "ROLLOUT_SIDECAR_ADMIN_PORT": str(free_port())}
    r = _sidecar_cli(env)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: engine at http://127.0.0.1:{port} not healthy after 1 s: unreachable"), (
        r.stderr
    )
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({E + "PODS": "2", E + "POD_INDEX": "2"}, f"error: {E}POD_INDEX: 2 must be below pods (2)"),
        ({E + "TOP_P": "2"}, f"error: {E}TOP_P: Input should be less than or equal to 1"),
        ({E + "PODZ": "2"}, f"error: {E}PODZ: unknown setting"),
        ({E + "PROMPTS_PATH": "/nonexistent/p.jsonl"}, f"error: {E}PROMPTS_PATH: prompts file not found"),
        ({E + "TOKEN_FILE": "/nonexistent/key"}, f"error: {E}TOKEN_FILE: token file not found"),
        ({E + "MODE": "service", E + "ENGINE_URL": "ftp://x"}, f"error: {E}ENGINE_URL: String should match"),
    ],
)  # fmt: skip
def test_bad_settings_exit_2_naming_the_variable(
    tmp_path: Path, prompts: Path, extra: dict[str, str], message: str
) -> None:
    env = sidecar_env(None, tmp_path, prompts_path=prompts, output_dir=tmp_path / "out") | extra
    r = _sidecar_cli(env)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(message), r.stderr


def test_exit_with_parent_stops_the_sidecar_when_its_parent_is_killed(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # no engine: the sidecar waits for one
    env = sidecar_env(None, tmp_path, mode="service", engine_url=url, exit_with_parent=True)
    env |= {"ROLLOUT_SIDECAR_PORT": str(free_port()), "ROLLOUT_SIDECAR_ADMIN_PORT": str(free_port())}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_SIDECAR_")}
    log = tmp_path / "sidecar.log"
    parent_code = (
        "import subprocess, sys, time\n"
        f"out = open({str(log)!r}, 'wb')\n"
        "cmd = [sys.executable, '-m', 'rollout_operator.cli.main', 'sidecar']\n"
        "p = subprocess.Popen(cmd, stdout=out, stderr=out)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], env={**clean, **env}, stdout=subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        wait_until(lambda: "sidecar (service mode" in log.read_text(), what="the sidecar to start")
        assert alive([pid]) == [pid]
    finally:
        parent.kill()  # SIGKILL: the parent cleans nothing up
        parent.wait(10)
    wait_until(lambda: not alive([pid]), timeout=15, what="the sidecar to stop")
    assert "the parent process" in log.read_text() and "sidecar stopped" in log.read_text()
