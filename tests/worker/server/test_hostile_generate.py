"""``/generate`` as a hostile prober met it (issue 35), on a real server of 2 replicas (2x1, float64): a
request id reused while its request runs is refused and the running request finishes untouched; a body
beyond the fan-out bound (prompts x n) is refused, and one at it is validated, submitted, run and answered,
while ``/health`` stays live; ``/get_load`` reports the KV tokens each replica holds."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from rollout_worker.api.sglang import MAX_REQUESTS_PER_BODY

from tests.waiting import wait_until
from tests.worker.server.served import Served

pytestmark = pytest.mark.multiproc
NEW = 1000  # tokens of the first request: it runs for a while, so that the second arrives meanwhile
LONG = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
LIVENESS_TIMEOUT_S = 1.0  # Kubernetes' default timeout of a liveness probe


def _in_flight(s: Served) -> list[dict[str, Any]]:
    """Every request the engine holds (running, waiting on a replica, queued in the driver)."""
    state = s.get("/v1/state").json()
    return [r for rep in state["replicas"] for r in rep["running"] + rep["waiting"]] + state["queued"]


def _decoding(s: Served, rids: list[str]) -> bool:
    running = {r["rid"]: r for rep in s.get("/v1/state").json()["replicas"] for r in rep["running"]}
    return all(rid in running and running[rid]["generated"] > 0 for rid in rids)


def _finals(s: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The final output of each request of ``body`` (streamed: each index's last chunk, the stream ending
    with ``[DONE]``)."""
    if not body.get("stream"):
        r = s.post("/generate", body, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        return got if isinstance(got, list) else [got]
    with s.client(timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    finals: dict[int, dict[str, Any]] = {}
    for chunk in map(json.loads, events[:-1]):
        finals[chunk.get("index", 0)] = chunk
    return [finals[i] for i in sorted(finals)]


def _background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


# (the first request's n, its sub-requests' ids from rid R, the second body's fields that reuse one of them)
REUSES = {
    "plain": (1, ["R"], {"input_ids": [3], "rid": "R"}),
    "sub-rid of n=2": (2, ["R-0", "R-1"], {"input_ids": [3], "rid": "R-1"}),
    "streamed": (1, ["R"], {"input_ids": [3], "rid": "R", "stream": True}),
    "in a batch": (2, ["R-0", "R-1"], {"input_ids": [[3], [4]], "rid": ["other", "R-0"]}),
}


@pytest.mark.parametrize("first_streamed", [False, True], ids=["first plain", "first streamed"])
@pytest.mark.parametrize("reuse", list(REUSES))
def test_a_reused_rid_is_refused_and_the_running_request_finishes_untouched(
    server: Served, reuse: str, first_streamed: bool
) -> None:
    n, subs, second = REUSES[reuse]
    tag = f"{reuse}-{first_streamed}".replace(" ", "_")
    rename = {r: f"{tag}-{r}" for r in [*subs, "R", "other"]}
    subs = [rename[r] for r in subs]
    rid = second["rid"]
    second = {**second, "rid": [rename[r] for r in rid] if isinstance(rid, list) else rename[rid]}
    first = {"input_ids": [1, 2], "rid": rename["R"], "sampling_params": {**LONG, "n": n}}
    t, got = _background(lambda: _finals(server, {**first, "stream": first_streamed}))
    wait_until(lambda: _decoding(server, subs), what="the first request to decode", timeout=60)

    r = server.post("/generate", {**second, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400, r.text  # (a stream refused before it starts: an HTTP error, not a chunk)
    err = r.json()["error"]
    assert err["field"] == "rid" and "already in flight" in err["message"], err

    t.join(120)
    assert not t.is_alive() and got, "the first request's client got no answer"
    assert [o["meta_info"]["id"] for o in got[0]] == subs
    for out in got[0]:  # every token, not aborted
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW}, out["meta_info"]
        assert len(out["output_ids"]) == NEW
    assert _in_flight(server) == []  # nothing of the refused body was left running
    if isinstance(second["rid"], list):  # its other id was never taken: it can be used at once
        free = {"input_ids": [5], "rid": second["rid"][0], "sampling_params": {"max_new_tokens": 1}}
        assert server.post("/generate", free).status_code == 200


def _health_latencies(
    server: Served, until: threading.Event
) -> tuple[threading.Thread, list[float], set[int]]:
    """A second client probing /health every 5 ms until ``until``: (its thread, latencies, status codes)."""
    latencies: list[float] = []
    codes: set[int] = set()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not until.is_set():
                start = time.perf_counter()
                codes.add(c.get("/health").status_code)
                latencies.append(time.perf_counter() - start)
                time.sleep(0.005)

    t = threading.Thread(target=probe)
    t.start()
    return t, latencies, codes


def _while_probed(server: Served, body: dict[str, Any]) -> tuple[httpx.Response, list[float], set[int]]:
    """``body`` posted to /generate while a second client probes /health: (the answer, the probes'
    latencies, their status codes)."""
    done = threading.Event()
    prober, latencies, codes = _health_latencies(server, done)
    try:
        wait_until(lambda: len(latencies) >= 5, what="the prober to start")
        with server.client(timeout=300) as c:
            r = c.post("/generate", json=body)
    finally:
        done.set()
        prober.join(30)
    return r, latencies, codes


@pytest.mark.parametrize("prompts", [2000, 200])
def test_a_body_beyond_the_fan_out_bound_is_refused_and_health_stays_live(
    server: Served, prompts: int
) -> None:
    """The issue's bodies, 2,000 prompts x n=64 (128,000 requests in 16 KB; no route answered for about 2
    minutes) and 200 x 64 (12,800; /health stalled up to 14.7 s): refused with a 400 naming the prompts'
    field and the bound, while /health answers every probe far within a liveness probe's timeout."""
    body = {"input_ids": [[1, 2]] * prompts, "sampling_params": {"n": 64, "max_new_tokens": 1}}
    r, latencies, codes = _while_probed(server, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["field"] == "input_ids" and f"more than the {MAX_REQUESTS_PER_BODY}" in err["message"], err
    assert codes == {200} and max(latencies) < LIVENESS_TIMEOUT_S, (codes, sorted(latencies)[-5:])
    assert _in_flight(server) == []


def test_the_largest_body_allowed_is_answered_and_health_stays_live(server: Served) -> None:
    """The largest body allowed (prompts x n = the bound), with logprobs to render, while a second client
    probes /health: every request answered, and every probe answered 200 far within a liveness probe's
    timeout (the body's per-request work runs off the event loop)."""
    n = 64
    prompts = [[(7 * i + j) % 400 + 1 for j in range(64)] for i in range(MAX_REQUESTS_PER_BODY // n)]
    body = {
        "input_ids": prompts,
        "sampling_params": {"n": n, "max_new_tokens": 8, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    r, latencies, codes = _while_probed(server, body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == MAX_REQUESTS_PER_BODY
    assert all(len(o["meta_info"]["output_top_logprobs"]) == 8 for o in outs)
    assert codes == {200} and max(latencies) < LIVENESS_TIMEOUT_S, (codes, sorted(latencies)[-5:])


def test_get_load_reports_the_tokens_each_replica_holds(server: Served) -> None:
    """Two long requests, one per replica, paused in place mid-decode (their KV stays): /get_load's
    num_tokens per replica add up to what /v1/loads reports, and each replica holds some."""
    clients = [_post_in_background(server, [1 + i, 2, 3], f"load-{i}") for i in range(2)]
    wait_until(lambda: _decoding(server, ["load-0", "load-1"]), what="both requests to decode", timeout=60)
    assert server.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    try:  # (a step under way when the pause came reports once more: read until two reads agree)
        load, loads = wait_until(lambda: _loads(server), what="the KV use to settle while paused")
    finally:
        assert server.post("/continue_generation", {}).status_code == 200
        server.post("/abort_request", {"abort_all": True})
        for t in clients:
            t.join(60)
    assert [x["num_reqs"] for x in load] == [1, 1], load
    assert all(x["num_tokens"] > 3 for x in load), load  # the prompt and some output, on each replica
    assert sum(x["num_tokens"] for x in load) == loads["num_used_tokens"], (load, loads)


def _post_in_background(s: Served, prompt: list[int], rid: str) -> threading.Thread:
    body = {"input_ids": prompt, "rid": rid, "sampling_params": LONG}
    return _background(lambda: s.post("/generate", body, timeout=120))[0]


def _loads(s: Served) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """(/get_load, /v1/loads) when /get_load reads the same before and after /v1/loads, else None."""
    before, loads, after = s.get("/get_load").json(), s.get("/v1/loads").json(), s.get("/get_load").json()
    return (before, loads) if before == after else None
