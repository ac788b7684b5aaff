"""Control verbs on a real server: abort (one, all, client disconnect), pause / continue in every mode,
flush, weight updates from disk (and the weights root), memory release."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.engine.model.checkpoint import make_model

from tests.waiting import wait_until
from tests.worker.server.served import Served

pytestmark = pytest.mark.multiproc
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


def test_api_key_guards_every_route_but_health_and_metrics(ctl: Served) -> None:
    spec = ctl.get("/openapi.json").json()
    routes = [(m.upper(), path) for path, ops in spec["paths"].items() for m in ops]
    routes += [("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/docs"), ("GET", "/no/such/route")]
    assert len(routes) > 25
    with httpx.Client(base_url=ctl.url, timeout=10) as c:
        for method, path in routes:
            url = path.replace("{", "").replace("}", "")
            none = c.request(method, url)
            wrong = c.request(method, url, headers={"Authorization": "Bearer nope"})
            if path in ("/health", "/metrics"):  # /health_generate generates: it needs the key
                assert none.status_code == 200 and wrong.status_code == 200, path
            else:
                assert none.status_code == 401 and "bearer" in none.json()["error"]["message"], (method, path)
                assert wrong.status_code == 403, (method, path)
        assert c.get("/openapi.json").status_code == 401


def _stream(
    server: Served,
    body: dict[str, Any],
    out: list[dict[str, Any]],
    chunks_before: threading.Event | None = None,
    n: int = 5,
) -> None:
    with server.client(120) as c, c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
                if chunks_before is not None and len(out) >= n:
                    chunks_before.set()


def _running(server: Served) -> int:
    return sum(len(r["running"]) + len(r["waiting"]) for r in server.get("/v1/state").json()["replicas"])


def _state(server: Served) -> dict[str, Any]:
    got: dict[str, Any] = server.get("/v1/state").json()
    return got


def _request(state: dict[str, Any], rid: str) -> dict[str, Any] | None:
    """The unfinished request ``rid`` as a replica holds it (running or waiting), None when it has none."""
    held = [r for rep in state["replicas"] for r in rep["running"] + rep["waiting"] if r["rid"] == rid]
    return held[0] if held else None


def _idle(server: Served) -> bool:
    return _running(server) == 0


def test_abort_one_request_mid_decode(ctl: Served) -> None:
    chunks: list[dict[str, Any]] = []
    started = threading.Event()
    t = threading.Thread(
        target=_stream,
        args=(ctl, {"input_ids": [1, 2, 3], "sampling_params": LONG, "rid": "victim"}, chunks, started),
    )
    t.start()
    assert started.wait(30)
    r = ctl.post("/abort_request", {"rid": "victim"})
    assert r.status_code == 200 and r.json()["aborted"] == 1
    t.join(30)
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(last["output_ids"]) < 1500  # partial output comes back
    wait_until(lambda: _idle(ctl), what="no request left on the replicas")


def test_abort_all(ctl: Served) -> None:
    results: list[Any] = []

    def one(i: int) -> None:
        results.append(
            ctl.post("/generate", {"input_ids": [i + 1, 2], "sampling_params": LONG}, timeout=120).json()
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()

    def decoding() -> list[int] | None:  # every request on a replica, each with tokens generated
        generated = [r["generated"] for rep in _state(ctl)["replicas"] for r in rep["running"]]
        return generated if len(generated) == 3 and min(generated) > 0 else None

    wait_until(decoding, what="3 requests decoding")
    assert ctl.post("/abort_request", {"abort_all": True}).json()["aborted"] == 3
    for t in threads:
        t.join(30)
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort"] * 3
    assert all(0 < r["meta_info"]["completion_tokens"] < 1500 for r in results)


def _metric(server: Served, name: str) -> float:
    """A counter's value (0 before its first count: Prometheus shows a labelled counter from then on)."""
    lines = [x for x in server.get("/metrics").text.splitlines() if x.startswith(name + "{")]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def _aborted(server: Served) -> float:
    return _metric(server, "sglang:num_aborted_requests_total")


def test_a_client_gone_before_its_stream_began_frees_the_slot(ctl: Served) -> None:
    """A streamed request whose client closed the connection right after sending it: the server submits
    it, and the response sees the client gone before its first event; the requests are aborted then too
    (nothing else would: the events never started), not run to their last token."""
    for route, body in (
        ("/generate", {"input_ids": [4, 6], "sampling_params": LONG, "stream": True}),
        (
            "/v1/completions",
            {"model": "m", "prompt": [4, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True},
        ),
    ):
        before = _aborted(ctl)
        raw = json.dumps(body).encode()
        host, port = ctl.url.removeprefix("http://").split(":")
        head = f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        auth = f"Authorization: Bearer {ctl.key}\r\n" if ctl.key else ""
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"{head}{auth}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        wait_until(lambda b=before: _aborted(ctl) == b + 1, what=f"the {route} stream's request aborted")
        wait_until(lambda: _idle(ctl), what="the slot to be free again", timeout=10)


def test_client_disconnect_frees_the_slot(ctl: Served) -> None:
    before, step = _aborted(ctl), ctl.get("/v1/state").json()["step"]
    with (
        ctl.client() as c,
        c.stream(
            "POST", "/generate", json={"input_ids": [4, 5], "sampling_params": LONG, "stream": True}
        ) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client goes away
    wait_until(lambda: _idle(ctl), what="the slot to be free again", timeout=10)
    assert _aborted(ctl) == before + 1  # ... because the server aborted it
    lengths = ctl.get("/v1/state", params={"since_step": step}).json()["finished"]["lengths"]
    assert lengths and max(lengths) < 1500  # partial


def _stopped(server: Served) -> Any:
    """A predicate: the paused engine's state once its clock (``step``) has stopped between two reads."""
    last: list[int] = []

    def check() -> dict[str, Any] | None:
        state = _state(server)
        stopped, last[:] = last == [state["step"]], [state["step"]]
        return state if stopped and state["paused"] else None

    return check


def _paused_mid_stream(
    server: Served, body: dict[str, Any], mode: str
) -> tuple[threading.Thread, list[dict[str, Any]], dict[str, Any]]:
    """Stream ``body`` (its ``rid``) and pause once chunks come: the stream's thread, its chunks, and the
    engine's state once it stopped stepping."""
    chunks: list[dict[str, Any]] = []
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(server, body, chunks, started))
    t.start()
    assert started.wait(30)
    assert server.post("/pause_generation", {"mode": mode}).json()["status"] == "ok"
    # the ranks take the pause at their next step boundary; then the engine's clock stops. An engine that
    # did not pause keeps stepping until the request ends, which the callers' checks of the state catch.
    held = wait_until(_stopped(server), what=f"the engine to stop stepping after a pause ({mode})")
    return t, chunks, held


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_pause_and_continue(ctl: Served, mode: str) -> None:
    body = {"input_ids": [7, 8, 9], "sampling_params": {**LONG, "max_new_tokens": 300}}
    reference = ctl.post("/generate", body).json()["output_ids"]
    rid, late_rid = f"paused-{mode}", f"late-{mode}"
    t, chunks, held = _paused_mid_stream(ctl, {**body, "rid": rid}, mode)
    victim = _request(held, rid)
    if mode == "abort":
        assert victim is None  # finished (aborted) by the pause
    else:
        assert victim is not None and 0 < victim["generated"] < 300, held
    late: list[Any] = []
    waiter = threading.Thread(
        target=lambda: late.append(
            ctl.post(
                "/generate",
                {
                    "input_ids": [3, 3],
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                    "rid": late_rid,
                },
            ).json()
        )
    )
    waiter.start()
    # a request that comes while paused is accepted and held back: queued, on no replica
    wait_until(
        lambda: any(q["rid"] == late_rid for q in _state(ctl)["queued"]), what="the late request to be queued"
    )
    after = _state(ctl)
    assert after["step"] == held["step"] and after["paused"]  # nothing generated while paused
    assert _request(after, rid) == victim and _request(after, late_rid) is None
    assert not late
    assert ctl.post("/continue_generation", {}).json()["status"] == "ok"
    t.join(60)
    waiter.join(30)
    assert late and late[0]["meta_info"]["completion_tokens"] == 4
    final = chunks[-1]
    if mode == "abort":
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
    else:  # in place or retracted (KV dropped, recomputed later): the very same tokens
        assert final["output_ids"] == reference


def test_flush_cache_only_when_idle(ctl: Served) -> None:
    chunks: list[dict[str, Any]] = []
    started = threading.Event()
    t = threading.Thread(
        target=_stream,
        args=(ctl, {"input_ids": [6], "sampling_params": LONG, "rid": "busy"}, chunks, started),
    )
    t.start()
    assert started.wait(30)
    assert ctl.post("/flush_cache").status_code == 400
    ctl.post("/abort_request", {"rid": "busy"})
    t.join(30)
    wait_until(lambda: _idle(ctl), what="no request left on the replicas")
    r = ctl.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True


def test_samples_share_their_prompt_until_the_cache_is_flushed(ctl: Served) -> None:
    """Pages of one token (the default): the 3 samples after the first find 9 of the 10 prompt tokens
    cached, reported in meta_info and /metrics; after /flush_cache the prompt is computed again."""
    wait_until(lambda: _idle(ctl), what="no request left on the replicas")
    ctl.post("/flush_cache")
    body = {"input_ids": list(range(30, 40)), "sampling_params": {"max_new_tokens": 3, "n": 4}}
    before = _metric(ctl, "sglang:cached_tokens_total")
    r = ctl.post("/generate", body)
    assert r.status_code == 200, r.text
    assert sorted(o["meta_info"]["cached_tokens"] for o in r.json()) == [0, 9, 9, 9]
    assert _metric(ctl, "sglang:cached_tokens_total") - before == 27
    assert _metric(ctl, "sglang:cache_hit_rate") > 0
    again = ctl.post("/generate", {**body, "sampling_params": {"max_new_tokens": 3}})
    assert again.json()["meta_info"]["cached_tokens"] == 9  # a later request finds the pages too
    assert ctl.post("/flush_cache").json()["success"] is True
    again = ctl.post("/generate", {**body, "sampling_params": {"max_new_tokens": 3}})
    assert again.json()["meta_info"]["cached_tokens"] == 0


def _static(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    cfg = EngineConfig.load(str(model), 1, dtype="float64")
    specs = [RequestSpec(f"s{i}", tuple(p), 12, Sampling(), ignore_eos=True) for i, p in enumerate(prompts)]
    return [o["output_ids"] for o in run_batch(cfg, specs).outputs]


def test_update_weights_from_disk(ctl: Served, root: Path, tmp_path: Path) -> None:
    prompts = [[1, 2, 3], [40, 41], [200, 100, 50, 25]]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    before = [b["output_ids"] for b in ctl.post("/generate", body).json()]
    assert before == _static(root / "a", prompts)
    outside = tmp_path / "elsewhere"
    make_model("tiny", 9, outside, "float64")
    r = ctl.post("/update_weights_from_disk", {"model_path": str(outside)})
    assert r.status_code == 403 and r.json()["error"]["field"] == "model_path"
    r = ctl.post("/update_weights_from_disk", {"model_path": str(root / "a" / ".." / ".." / outside.name)})
    assert r.status_code in (400, 403)
    r = ctl.post("/update_weights_from_disk", {"model_path": str(root / "missing")})
    assert r.status_code == 400 and "config.json" in r.json()["error"]["message"]
    r = ctl.post("/update_weights_from_disk", {"model_path": str(root / "b"), "weight_version": "v2"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after = ctl.post("/generate", body).json()
    assert [b["output_ids"] for b in after] == _static(root / "b", prompts) != before
    assert after[0]["meta_info"]["weight_version"] == "v2"
    assert ctl.get("/get_model_info").json()["weight_version"] == "v2"


def test_a_disk_load_keeps_the_version_unless_given_and_reads_only_checkpoints_as_they_are(
    ctl: Served, root: Path
) -> None:
    prompts = [[1, 2, 3], [40, 41]]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }

    def version() -> str:
        return str(ctl.get("/get_weight_version").json()["weight_version"])

    def outputs() -> list[list[int]]:
        return [b["output_ids"] for b in ctl.post("/generate", body).json()]

    def loads() -> int:  # the planner's sign of new weights, named or not
        return int(ctl.get("/v1/state").json()["weight_loads"])

    r = ctl.post("/update_weights_from_disk", {"model_path": str(root / "a"), "weight_version": "step-7"})
    assert r.status_code == 200 and version() == "step-7", r.text
    # no weight_version: SGLang keeps the current one (it is not the path); null, auto and safetensors read
    # the checkpoint as it is
    for path, fmt in (("b", None), ("a", "auto"), ("b", "safetensors")):
        before = loads()
        r = ctl.post("/update_weights_from_disk", {"model_path": str(root / path), "load_format": fmt})
        assert r.status_code == 200, r.text
        assert outputs() == _static(root / path, prompts) and version() == "step-7", (path, fmt)
        assert loads() == before + 1
    before = loads()
    # a format SGLang defines that reads something else, and one it does not define: 400, nothing loaded
    for fmt, words in (("pt", "PyTorch .bin"), ("dummy", "random weights"), ("bogus", "not one of SGLang's")):
        r = ctl.post("/update_weights_from_disk", {"model_path": str(root / "a"), "load_format": fmt})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["field"] == "load_format" and words in error["message"] and fmt in error["message"]
        assert "Supported: null, 'auto', 'safetensors'" in error["message"], r.text
    assert outputs() == _static(root / "b", prompts) and version() == "step-7" and loads() == before


def _layout(server: Served) -> str:
    layout: str = server.get("/v1/state").json()["layout"]
    return layout


def _tokens_and_logprobs(out: dict[str, Any]) -> tuple[list[int], list[float]]:
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    return out["output_ids"], [lp for lp, _, _ in lps]


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_weight_update_while_paused_goes_ahead(ctl: Served, root: Path, mode: str) -> None:
    """slime's and VeRL's order, as SGLang serves it: pause, update the weights (SGLang's default
    ``abort_all_requests: false``), continue. The update answers while the engine is still paused (it does not
    wait for the paused request), and so does a layout switch; nothing runs until continue. Then the paused
    request finishes: its tokens before the pause are a's; the rest come from b: recomputed by b from prompt +
    those tokens (retract: exactly a fresh request's tokens and logprobs), or over the K/V that a computed for
    those positions (in place: logprobs unlike a fresh request's)."""
    prompt, n = [7, 8, 9], 300
    r = ctl.post("/update_weights_from_disk", {"model_path": str(root / "a"), "weight_version": "a"})
    assert r.status_code == 200, r.text
    body = {"input_ids": prompt, "sampling_params": {**LONG, "max_new_tokens": n}, "return_logprob": True}
    on_a, lp_a = _tokens_and_logprobs(ctl.post("/generate", body).json())
    rid = f"paused-update-{mode}"
    t, chunks, held = _paused_mid_stream(ctl, {**body, "rid": rid}, mode)
    victim = _request(held, rid)
    assert victim is not None and 0 < victim["generated"] < n, held
    k = victim["generated"]

    answers: list[httpx.Response] = []
    version = f"b-{mode}"
    update = {"model_path": str(root / "b"), "weight_version": version}
    threading.Thread(
        target=lambda: answers.append(ctl.post("/update_weights_from_disk", update, timeout=120))
    ).start()
    # the update answers with the request still paused (no continue sent): it did not wait for it
    wait_until(lambda: answers, what="the weight update to answer while paused", timeout=60)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["num_paused_requests"] == 1
    other = "1x2" if _layout(ctl) == "2x1" else "2x1"  # migrated: the K/V move as they are
    r = ctl.post("/v1/reconfigure", {"layout": other, "method": "migrate"}, timeout=120)
    assert r.status_code == 200 and r.json()["event"]["outcome"] == "committed", r.text
    after = _state(ctl)
    assert after["paused"] and after["weight_version"] == version
    assert (_request(after, rid) or {}).get("generated") == k  # nothing generated while paused
    assert ctl.post("/continue_generation", {}).json()["status"] == "ok"
    t.join(120)

    final = chunks[-1]
    out, lp = _tokens_and_logprobs(final)
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(out) == n
    assert final["meta_info"]["weight_version"] == version
    assert out[:k] == on_a[:k] and _gap(lp[:k], lp_a[:k]) < 1e-12  # before the pause: a's
    rest = {**body, "input_ids": prompt + out[:k], "sampling_params": {**LONG, "max_new_tokens": n - k}}
    again = ctl.post("/generate", rest).json()
    fresh, lp_fresh = _tokens_and_logprobs(again)  # every K/V b's
    if mode == "retract":  # re-prefilled by b: the very same tokens, logprobs to float64 rounding
        assert out[k:] == fresh and _gap(lp[k:], lp_fresh) < 1e-12
    else:  # b's weights over a's K/V of the first k positions (which never reach the prefix cache)
        assert again["meta_info"]["cached_tokens"] == 0
        assert _gap(lp[k:], lp_fresh) > 1e-6 and out[k:] != on_a[k:]
    assert ctl.post("/v1/reconfigure", {"layout": "2x1"}, timeout=120).status_code == 200


def test_a_pause_lets_a_waiting_weight_update_go_ahead(ctl: Served, root: Path) -> None:
    """An update sent while a request runs waits for it, holding new requests back; a pause (in place) then
    lets it load at once, as if the pause had come first."""
    chunks: list[dict[str, Any]] = []
    started = threading.Event()
    body = {"input_ids": [5, 6], "sampling_params": LONG, "rid": "runs-on"}
    t = threading.Thread(target=_stream, args=(ctl, body, chunks, started))
    t.start()
    assert started.wait(30)
    answers: list[httpx.Response] = []
    update = {"model_path": str(root / "a"), "weight_version": "a-after-pause"}
    threading.Thread(
        target=lambda: answers.append(ctl.post("/update_weights_from_disk", update, timeout=120))
    ).start()
    late: list[httpx.Response] = []

    def until_held() -> None:  # short requests, until one is held back (the update holds new ones)
        short = {"input_ids": [3, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        while not late or late[-1].json()["meta_info"]["weight_version"] != "a-after-pause":
            late.append(ctl.post("/generate", short, timeout=120))

    threading.Thread(target=until_held, daemon=True).start()
    # the update waits for the running request: a late one is held back in the driver's queue
    wait_until(lambda: _state(ctl)["queued"], what="a late request held back")
    assert not answers
    assert ctl.post("/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    wait_until(lambda: answers, what="the waiting update to answer once paused", timeout=60)
    assert answers[0].status_code == 200 and answers[0].json()["num_paused_requests"] == 2, answers[0].text
    assert ctl.post("/continue_generation", {}).json()["status"] == "ok"
    wait_until(  # the one held back runs after continue, on the new weights
        lambda: late and late[-1].json()["meta_info"]["weight_version"] == "a-after-pause",
        what="the late request to finish after continue",
        timeout=60,
    )
    ctl.post("/abort_request", {"rid": "runs-on"})  # (to end it sooner)
    t.join(60)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_release_and_resume_memory(ctl: Served) -> None:
    body = {
        "input_ids": [5, 5, 5],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    before = ctl.post("/generate", body).json()["output_ids"]
    assert ctl.post("/release_memory_occupation", {"tags": None}).status_code == 200
    r = ctl.post("/generate", body)
    assert r.status_code == 503 and "released" in r.json()["error"]["message"]
    assert ctl.post("/resume_memory_occupation", {}).status_code == 200
    assert ctl.post("/generate", body).json()["output_ids"] == before
