"""The real ``sglang-router`` (PyPI, slime's gateway) in front of two ``rolloutctl serve`` engines (loopback,
API keys), driven as slime drives it: workers registered with ``POST /workers``, generation through the
router (it adds its own top-level keys to every body), the end-of-step abort (the router's worker list, then
``/abort_request {"abort_all": true}`` to each engine: router 0.3.2 has no ``/abort_request`` of its own),
and the router's health probes answered by the engines."""

from __future__ import annotations

import itertools
import json
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_worker.proc import Child, free_port, spawn, stop

from tests.waiting import wait_until
from tests.worker.server.served import Served, start
from tests.worker.server.test_control import LONG, _idle, _static

pytestmark = pytest.mark.multiproc
PROMPTS = [[1, 2, 3], [40, 41], [200, 100, 50, 25], [7]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
KEY = "engine-key"  # the engines' API key (pods always have one), given to the router with each worker


@dataclass
class Routed:
    router: Child
    url: str
    engines: list[Served]

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def workers(self) -> list[dict[str, Any]]:
        with self.client() as c:
            got: list[dict[str, Any]] = c.get("/workers").json()["workers"]
        return got


@pytest.fixture(scope="module")
def routed(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    tmp = tmp_path_factory.mktemp("router")
    with ThreadPoolExecutor(2) as pool:  # two engines of one rank each, started side by side
        engines = list(
            pool.map(lambda _: start(tiny64, tmp, "--ranks", "1", "--dtype", "float64", key=KEY), range(2))
        )
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--policy", "round_robin", "--health-check-interval-secs", "1", "--log-level", "warn"]
    router = spawn("sglang-router", argv, tmp / "router.log", with_parent=True)
    routed = Routed(router, f"http://127.0.0.1:{port}", engines)
    try:
        wait_until(lambda: _answers(routed.url + "/liveness"), what="the router", explain=router.tail)
        with routed.client() as c:
            for e in engines:
                r = c.post("/workers", json={"url": e.url, "worker_type": "regular", "api_key": KEY})
                assert r.status_code == 202, r.text
        yield routed
    finally:
        stop([router.proc])
        for e in engines:
            e.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _registered(routed: Routed) -> list[dict[str, Any]] | None:
    ws = routed.workers()
    return ws if len(ws) == 2 and all(w["is_healthy"] for w in ws) else None


def _served(e: Served) -> float:
    """Requests the engine finished (its Prometheus counter, absent before the first)."""
    lines = [x for x in e.get("/metrics").text.splitlines() if x.startswith("sglang:num_requests_total")]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def test_workers_register_with_what_the_engines_report(routed: Routed) -> None:
    ws = wait_until(lambda: _registered(routed), what="two healthy workers", explain=routed.router.tail)
    assert sorted(w["url"] for w in ws) == sorted(e.url for e in routed.engines)
    for w in ws:  # read from the engines' /server_info and /model_info at registration
        assert w["worker_type"] == "regular" and w["connection_mode"] == "HTTP"
        assert (w["metadata"]["tp_size"], w["metadata"]["dp_size"]) == ("1", "1")
        assert (
            w["model_id"]
            == w["metadata"]["model_path"]
            == routed.engines[0].get("/model_info").json()["model_path"]
        )
    with routed.client() as c:
        assert c.get("/readiness").json() == {"status": "ready", "healthy_workers": 2, "total_workers": 2}


def test_generate_through_the_router(routed: Routed) -> None:
    wait_until(lambda: _registered(routed), what="two healthy workers", explain=routed.router.tail)
    before = [_served(e) for e in routed.engines]
    with routed.client() as c:
        # slime's body; the router drops ``stop: null`` and adds its own keys (model, log_metrics, ...)
        body = {"sampling_params": {**GREEDY, "stop": None}, "return_logprob": True}
        out = [c.post("/generate", json={"input_ids": p, **body}).json() for p in PROMPTS]
    static = _static(_model(routed), PROMPTS)
    assert [o["output_ids"] for o in out] == static
    for o, s in zip(out, static, strict=True):
        assert [t for _, t, _ in o["meta_info"]["output_token_logprobs"]] == s
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    # round robin: each engine served half of them
    assert [_served(e) - b for e, b in zip(routed.engines, before, strict=True)] == [2, 2]


def _model(routed: Routed) -> Path:
    return Path(routed.engines[0].get("/model_info").json()["model_path"])


def _stream(
    routed: Routed, body: dict[str, Any], out: list[Any], started: threading.Event | None = None
) -> None:
    with routed.client(120) as c, c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if started is not None and len(out) >= 3:
                    started.set()


def test_stream_through_the_router(routed: Routed) -> None:
    wait_until(lambda: _registered(routed), what="two healthy workers", explain=routed.router.tail)
    static = _static(_model(routed), PROMPTS[:2])
    for prompt, want in zip(PROMPTS[:2], static, strict=True):
        chunks: list[Any] = []
        _stream(routed, {"input_ids": prompt, "sampling_params": GREEDY}, chunks)
        assert chunks[-1] == "[DONE]", chunks
        ids = [c["output_ids"] for c in chunks[:-1]]
        assert len(ids) > 1 and ids[-1] == want  # cumulative: each chunk a longer prefix
        assert all(want[: len(x)] == x and len(x) < len(y) for x, y in itertools.pairwise(ids))
        assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_all_at_the_end_of_a_step_as_slime_does(routed: Routed) -> None:
    wait_until(lambda: _registered(routed), what="two healthy workers", explain=routed.router.tail)
    results: list[list[Any]] = [[], []]
    started = [threading.Event(), threading.Event()]
    bodies = [{"input_ids": [i + 1, 2], "sampling_params": LONG} for i in range(2)]
    threads = [
        threading.Thread(target=_stream, args=(routed, bodies[i], results[i], started[i])) for i in range(2)
    ]
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in started)
    # slime: the router's worker list, then abort_all on each worker, then poll /v1/loads until idle
    aborted = 0
    for w in routed.workers():
        r = httpx.post(w["url"] + "/abort_request", json={"abort_all": True}, headers=_auth(), timeout=30)
        assert r.status_code == 200, r.text
        aborted += r.json()["aborted"]
    assert aborted == 2
    for t in threads:
        t.join(30)
    for chunks in results:
        assert chunks[-1] == "[DONE]"
        assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < chunks[-2]["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
    for e in routed.engines:
        wait_until(lambda e=e: _idle(e), what="no request left")
        loads = e.get("/v1/loads", params={"include": "core"}).json()["loads"]
        assert all(x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0 for x in loads)


def test_health_probes_answered(routed: Routed) -> None:
    """The router probes each engine's /health every second; a stopped engine is marked unhealthy (so the
    probes reached it), and generation goes on through the other. Last in the module: it stops an engine."""
    wait_until(lambda: _registered(routed), what="two healthy workers", explain=routed.router.tail)
    with routed.client() as c:
        for path in ("/health", "/liveness", "/readiness", "/health_generate"):
            assert c.get(path).status_code == 200, path
    gone = routed.engines[1]
    assert gone.stop() == 0

    def marked() -> bool:
        return [w["is_healthy"] for w in routed.workers() if w["url"] == gone.url] == [False]

    wait_until(marked, what="the stopped engine marked unhealthy", explain=routed.router.tail)
    with routed.client() as c:
        for p in PROMPTS[:2]:
            r = c.post("/generate", json={"input_ids": p, "sampling_params": GREEDY})
            assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length", r.text
        assert c.get("/readiness").json()["healthy_workers"] == 1
