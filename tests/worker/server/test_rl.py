"""What RL frameworks (slime, VeRL) call besides generation, on a real server: ``/server_info`` as SGLang
reports it, memory release / resume with SGLang's tags, weight versions, weights sent as tensors (VeRL's
pairs, slime's flattened buckets)."""

from __future__ import annotations

import base64
import json
import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save

from tests.waiting import wait_until
from tests.worker.server.served import Served
from tests.worker.server.sglang_tensors import (
    FlattenedTensorMetadata,
    file_system_sharing,
    flattened_buckets,
    per_rank,
    serialize,
)
from tests.worker.server.test_control import LONG, _idle, _static, _stream

pytestmark = pytest.mark.multiproc
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_server_info_as_sglang_reports_it(ctl: Served) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = ctl.get(path).json()
        assert info["enable_memory_saver"] is False  # SGLang's default (slime: --offload-rollout off)
        assert info["num_gpus"] == 2  # the engine's ranks: slime sizes its weight-update group by them
        assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 2, 1)
        assert isinstance(info["max_total_num_tokens"], int) and info["max_total_num_tokens"] > 0
        assert info["weight_version"] == ctl.get("/get_weight_version").json()["weight_version"]
        assert set(info["memory_tags"]) == {"weights", "kv_cache", "cuda_graph"}
        assert isinstance(info["internal_states"], list) and info["version"]


def _gen(s: Served, body: dict[str, Any]) -> httpx.Response:
    return s.post("/generate", body)


def test_memory_release_and_resume_with_sglangs_tags(ctl: Served) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY}
    before = _gen(ctl, body).json()["output_ids"]
    # slime: release everything, resume the weights (then load new ones), then the KV cache and graphs
    assert ctl.post("/release_memory_occupation", {}).status_code == 200
    assert _gen(ctl, body).status_code == 503
    r = ctl.post("/resume_memory_occupation", {"tags": ["weights"]})
    assert r.status_code == 200, r.text
    r = _gen(ctl, body)
    assert r.status_code == 503 and "kv_cache" in r.json()["error"]["message"]
    r = ctl.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    assert r.status_code == 200, r.text
    assert _gen(ctl, body).json()["output_ids"] == before
    # cuda_graph alone (a no-op without graphs), and a tag SGLang does not have
    for verb in ("release", "resume"):
        assert ctl.post(f"/{verb}_memory_occupation", {"tags": ["cuda_graph"]}).status_code == 200
    assert _gen(ctl, body).json()["output_ids"] == before
    r = ctl.post("/release_memory_occupation", {"tags": ["kv_cache", "gpu"]})
    assert r.status_code == 400 and r.json()["error"]["field"].startswith("tags"), r.text


RELEASED = "memory released"  # what a request refused while memory is released is told
SHORT = {**GREEDY, "max_new_tokens": 2}


def _held(s: Served) -> list[dict[str, int]]:
    """What each rank said it holds (once started, and after each release / resume)."""
    held: list[dict[str, int]] = s.get("/server_info").json()["memory_held"]
    return held


def _one(c: httpx.Client, prompt: list[int], stream: bool) -> list[int] | str:
    """The request's output ids, or the error it was refused with (a 503, before a stream starts)."""
    body = {"input_ids": prompt, "sampling_params": SHORT, "stream": stream}
    if not stream:
        r = c.post("/generate", json=body)
        assert r.status_code in (200, 503), r.text
        return r.json()["output_ids"] if r.status_code == 200 else str(r.json()["error"]["message"])
    with c.stream("POST", "/generate", json=body) as r:
        assert r.status_code in (200, 503)
        if r.status_code == 503:
            return str(json.loads(r.read())["error"]["message"])
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][6:])
    return str(last["error"]["message"]) if "error" in last else list(last["output_ids"])


def _racer(s: Served, prompt: list[int], stream: bool, stop: threading.Event, out: list[Any]) -> None:
    """Send the request again and again until ``stop``; appends (prompt, outcome) for each."""
    with s.client(120) as c:
        while not stop.is_set():
            try:
                out.append((prompt, _one(c, prompt, stream)))
            except Exception as exc:  # e.g. the server died: recorded, and the test fails on it
                out.append((prompt, repr(exc)))
                return


def _until_released(s: Served) -> httpx.Response | None:
    """One release; None while requests in flight refuse it (400 naming tags)."""
    r = s.post("/release_memory_occupation", {})
    if r.status_code == 400 and r.json()["error"]["field"] == "tags":
        return None
    return r


@pytest.mark.long
def test_requests_racing_a_memory_release_and_resume(ctl: Served) -> None:
    """Requests (streamed and not) sent back to back while memory is released and resumed 20 times: each
    completes with the tokens it gets alone, or is refused with the documented error (503 memory released,
    streamed or not); no rank fails (a request that reached a rank after its release
    crashed it). A release refused while requests are in flight (400 naming tags) is sent again. Right after
    a release returns, every rank says it holds no weights and no KV; right after a resume, every rank holds
    its weights again and the KV pools what they held."""
    prompts = [[9, i, 4] for i in range(1, 5)]
    alone = {
        tuple(p): _gen(ctl, {"input_ids": p, "sampling_params": SHORT}).json()["output_ids"] for p in prompts
    }
    start = _held(ctl)
    assert all(h["weights_bytes"] > 0 for h in start), start
    stop = threading.Event()
    outcomes: list[tuple[list[int], list[int] | str]] = []
    racers = [
        threading.Thread(target=_racer, args=(ctl, p, i % 2 == 0, stop, outcomes))
        for i, p in enumerate(prompts)
    ]
    for t in racers:
        t.start()
    try:
        for _ in range(20):
            r = wait_until(lambda: _until_released(ctl), what="a release between requests", timeout=120)
            assert r.status_code == 200, r.text
            held = _held(ctl)  # as the ranks said before the call returned
            assert all(h == {"weights_bytes": 0, "kv_cache_bytes": 0} for h in held), held
            r = ctl.post("/resume_memory_occupation", {})
            assert r.status_code == 200, r.text
            held = _held(ctl)
            assert [h["weights_bytes"] for h in held] == [h["weights_bytes"] for h in start], held
            assert sum(h["kv_cache_bytes"] for h in held) > 0, held
    finally:
        stop.set()
        for t in racers:
            t.join(120)
    refused = [got for _, got in outcomes if isinstance(got, str)]
    assert all(RELEASED in got for got in refused), {*refused}
    assert all(got == alone[tuple(p)] for p, got in outcomes if not isinstance(got, str))
    assert ctl.get("/health").status_code == 200  # no rank failed
    assert all(
        _gen(ctl, {"input_ids": p, "sampling_params": SHORT}).json()["output_ids"] == alone[tuple(p)]
        for p in prompts
    )


def _long_request(s: Served, rid: str) -> tuple[threading.Thread, list[dict[str, Any]]]:
    chunks: list[dict[str, Any]] = []
    started = threading.Event()
    body = {"input_ids": [1, 2, 3], "sampling_params": LONG, "rid": rid}
    t = threading.Thread(target=_stream, args=(s, body, chunks, started))
    t.start()
    assert started.wait(30)
    return t, chunks


def test_weight_version(ctl: Served) -> None:
    r = ctl.post("/update_weight_version", {"new_version": "step-1"})
    assert r.status_code == 200 and r.json() == {
        "success": True,
        "message": "Weight version updated to step-1",
        "new_version": "step-1",
    }
    assert ctl.get("/get_weight_version").json() == {"weight_version": "step-1"}
    assert ctl.get("/model_info").json()["weight_version"] == "step-1"
    assert ctl.get("/server_info").json()["weight_version"] == "step-1"
    out = _gen(ctl, {"input_ids": [[5], [6]], "sampling_params": GREEDY}).json()
    assert [o["meta_info"]["weight_version"] for o in out] == ["step-1", "step-1"]
    # SGLang aborts what is running unless told not to
    t, chunks = _long_request(ctl, "wv-abort")
    assert ctl.post("/update_weight_version", {"new_version": "step-2"}).status_code == 200
    t.join(30)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until(lambda: _idle(ctl), what="no request left")
    t, chunks = _long_request(ctl, "wv-keep")
    body = {"new_version": "step-3", "abort_all_requests": False}
    assert ctl.post("/update_weight_version", body).status_code == 200
    ctl.post("/abort_request", {"rid": "wv-keep"})  # (to end it sooner; it was not aborted by the update)
    t.join(30)
    assert chunks[-1]["meta_info"]["finish_reason"]["message"] == "aborted by abort_request"
    assert ctl.get("/get_weight_version").json()["weight_version"] == "step-3"
    for bad in ({"new_version": ""}, {}, {"new_version": 3}):
        r = ctl.post("/update_weight_version", bad)
        assert r.status_code == 400 and r.json()["error"]["field"] == "new_version", r.text


def test_mutating_routes_need_the_key(ctl: Served) -> None:
    with httpx.Client(base_url=ctl.url, timeout=10) as c:
        for path in ("/update_weight_version", "/release_memory_occupation", "/resume_memory_occupation"):
            assert c.post(path, json={"new_version": "x"}).status_code == 401, path
        assert c.get("/get_weight_version").status_code == 401
    assert ctl.get("/get_weight_version").json()["weight_version"] != "x"


# -- update_weights_from_tensor --------------------------------------------------------------------------


def _tensors(model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model / "model.safetensors"))


def _pickled(named: list[tuple[str, Any]]) -> str:
    """What SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` makes: base64."""
    return base64.b64encode(serialize(named)).decode()


def _verl_body(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The body VeRL's HttpServerAdapter posts (SGLang's weight_sync.utils.update_weights, TP 2)."""
    payloads = [base64.b64encode(p).decode() for p in per_rank(tensors)]
    return {"serialized_named_tensors": payloads, "load_format": None, "flush_cache": True}


PROMPTS = [[1, 2, 3], [40, 41], [200, 100, 50, 25]]
BATCH = {
    "input_ids": PROMPTS,
    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
}


def _outputs(s: Served) -> list[list[int]]:
    return [b["output_ids"] for b in s.post("/generate", BATCH).json()]


def test_update_weights_from_tensor(ctl: Served, root: Path) -> None:
    with file_system_sharing():
        _update_weights_from_tensor(ctl, root)


def _update_weights_from_tensor(ctl: Served, root: Path) -> None:
    a, b = _tensors(root / "a"), _tensors(root / "b")
    static_a, static_b = _static(root / "a", PROMPTS), _static(root / "b", PROMPTS)
    assert static_a != static_b
    ctl.post("/update_weights_from_disk", {"model_path": str(root / "a"), "weight_version": "a"})
    assert _outputs(ctl) == static_a
    # VeRL's form, in two buckets (the first alone gives neither checkpoint's outputs)
    names = sorted(b)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    r = ctl.post("/update_weights_from_tensor", _verl_body({n: b[n] for n in first}))
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    mixed = _outputs(ctl)
    assert mixed not in (static_a, static_b)
    body = {**_verl_body({n: b[n] for n in second}), "weight_version": "b-verl"}
    assert ctl.post("/update_weights_from_tensor", body).status_code == 200
    out = ctl.post("/generate", BATCH).json()
    assert [o["output_ids"] for o in out] == static_b
    assert out[0]["meta_info"]["weight_version"] == "b-verl"
    # the safe form (safetensors bytes), back to a: the version is kept when none is given
    body = {"serialized_named_tensors": [base64.b64encode(save(a)).decode()]}
    assert ctl.post("/update_weights_from_tensor", body).status_code == 200
    assert _outputs(ctl) == static_a
    assert ctl.get("/get_weight_version").json()["weight_version"] == "b-verl"
    # a plain list of (name, tensor) pairs in a pickle (SGLang's Engine API form) works too
    body = {"serialized_named_tensors": [_pickled(list(b.items()))]}
    assert ctl.post("/update_weights_from_tensor", body).status_code == 200
    assert _outputs(ctl) == static_b


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


def test_a_bad_tensor_payload_is_a_400(ctl: Served, root: Path) -> None:
    with file_system_sharing():
        _bad_tensor_payloads(ctl, root)


def _bad_tensor_payloads(ctl: Served, root: Path) -> None:
    b = _tensors(root / "b")
    before = _outputs(ctl)
    name = "model.norm.weight"
    bad: list[tuple[Any, str]] = [
        (["not base64!"], "serialized_named_tensors.0"),
        ([base64.b64encode(b"junk bytes").decode()], "serialized_named_tensors.0"),
        ([], "serialized_named_tensors"),
        ([base64.b64encode(save({"no.such.tensor": b[name]})).decode()], "serialized_named_tensors"),
        ([base64.b64encode(save({name: b[name][:3].clone()})).decode()], "serialized_named_tensors"),
        ([base64.b64encode(save({name: b[name].long()})).decode()], "serialized_named_tensors"),
        ([_pickled([(name, _Evil())])], "serialized_named_tensors"),
        ([_pickled({"a": 1})], "serialized_named_tensors"),  # type: ignore[arg-type]
        ([base64.b64encode(b"\x80\x04garbage").decode()], "serialized_named_tensors"),
        ("x", "serialized_named_tensors"),
    ]
    for payload, field in bad:
        r = ctl.post("/update_weights_from_tensor", {"serialized_named_tensors": payload})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (payload, r.text)
    assert ctl.get("/health").status_code == 200 and _outputs(ctl) == before


def _bucket_body(tensors: dict[str, torch.Tensor], **extra: Any) -> list[dict[str, Any]]:
    """The bodies slime's colocated path posts for these tensors (TP 2): flattened buckets of the current
    generation (one), or with ``older=True`` of the older one (one per dtype)."""
    older = extra.pop("older", False)
    return [
        {
            "serialized_named_tensors": [base64.b64encode(p).decode() for p in payloads],
            "load_format": "flattened_bucket",
            **extra,
        }
        for payloads in flattened_buckets(tensors, older=older)
    ]


def test_update_weights_from_tensor_in_flattened_buckets(ctl: Served, root: Path) -> None:
    with file_system_sharing():
        _flattened_buckets(ctl, root)


def _flattened_buckets(ctl: Served, root: Path) -> None:
    a, b = _tensors(root / "a"), _tensors(root / "b")
    assert ctl.post("/update_weights_from_disk", {"model_path": str(root / "b")}).status_code == 200
    from_disk = _outputs(ctl)
    assert from_disk == _static(root / "b", PROMPTS)
    assert ctl.post("/update_weights_from_disk", {"model_path": str(root / "a")}).status_code == 200
    assert _outputs(ctl) != from_disk
    # the current generation: every tensor in one bucket; outputs equal the disk load of the same checkpoint
    (body,) = _bucket_body(b, weight_version="b-bucket", flush_cache=False)
    r = ctl.post("/update_weights_from_tensor", body)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _outputs(ctl) == from_disk
    assert ctl.get("/get_weight_version").json()["weight_version"] == "b-bucket"
    # the older generation, back to a in two requests as a sender with two buckets makes them (the version is
    # kept when none is given)
    names = sorted(a)
    for half in (names[: len(names) // 2], names[len(names) // 2 :]):
        for body in _bucket_body({n: a[n] for n in half}, older=True):
            assert ctl.post("/update_weights_from_tensor", body).status_code == 200
    assert _outputs(ctl) == _static(root / "a", PROMPTS)
    assert ctl.get("/get_weight_version").json()["weight_version"] == "b-bucket"
    # a bucket naming a tensor the model does not have, one whose offsets run past its tensor: refused whole
    name = "model.norm.weight"
    (body,) = _bucket_body({name: b[name], "model.no.such.weight": b[name]})
    r = ctl.post("/update_weights_from_tensor", body)
    assert r.status_code == 400 and "model.no.such.weight" in r.json()["error"]["message"], r.text
    flat = b[name].flatten().view(torch.uint8)
    meta = FlattenedTensorMetadata(name, b[name].shape, b[name].dtype, 8, 8 + flat.numel(), flat.numel())
    payload = base64.b64encode(serialize({"flattened_tensor": flat, "metadata": [meta]})).decode()
    r = ctl.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "serialized_named_tensors.0.metadata.0.end_idx", r.text
    assert _outputs(ctl) == _static(root / "a", PROMPTS)


def test_tensor_load_formats_the_engine_does_not_read_are_refused(ctl: Served) -> None:
    """SGLang's ``direct`` and custom loaders (VeRL's delta path names its loader), and a value SGLang does
    not define: a 400 naming load_format, saying why and what is supported, before anything is read."""
    before = _outputs(ctl)
    body = {"serialized_named_tensors": ["not read"]}
    for fmt, words in (
        ("direct", "SGLang's own parameters"),
        ("verl.workers.rollout.sglang_rollout.delta_loader.apply_delta", "custom weight loader"),
        ("bogus", "not one of SGLang's load formats"),
    ):
        r = ctl.post("/update_weights_from_tensor", {**body, "load_format": fmt})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["field"] == "load_format" and words in error["message"], r.text
        assert fmt in error["message"] and "Supported: null, 'flattened_bucket'" in error["message"], r.text
    assert _outputs(ctl) == before
