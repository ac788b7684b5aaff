"""Weight sync from a trainer by torch.distributed (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``): a trainer process broadcasts checkpoint b while requests run at 2x1;
after the update, and after a switch to 1x2, outputs equal b's static run token for token (float64)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.checkpoint_index import tensor_shapes
from rollout_worker.errors import UserError
from rollout_worker.proc import free_port
from rollout_worker.server.tensor_update import check_announced

from tests.waiting import wait_until
from tests.worker.server.served import Served
from tests.worker.server.test_control import _idle, _static, _stream

PROMPTS = [[1, 2, 3], [40, 41], [200, 100, 50, 25]]
BATCH = {
    "input_ids": PROMPTS,
    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
}
RUNNING = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


def _outputs(s: Served) -> list[dict[str, Any]]:
    r = s.post("/generate", BATCH)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _trainer(s: Served, checkpoint: Path, version: str, *bucket: str) -> list[dict[str, Any]]:
    assert s.key is not None
    cmd = [sys.executable, "-m", "tests.worker.server.weight_trainer", s.url, s.key, str(free_port()), "2"]
    done = subprocess.run(
        [*cmd, str(checkpoint), version, *bucket], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr + s.tail()
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_a_trainer_broadcasts_new_weights_while_requests_run(ctl: Served, root: Path) -> None:
    static_b = _static(root / "b", PROMPTS)
    assert [o["output_ids"] for o in _outputs(ctl)] != static_b  # the server starts on a
    assert ctl.get("/v1/state").json()["layout"] == "2x1"
    chunks: list[list[dict[str, Any]]] = [[], []]
    started = [threading.Event(), threading.Event()]
    running = [
        threading.Thread(
            target=_stream, args=(ctl, {"input_ids": p, "sampling_params": RUNNING}, chunks[i], started[i])
        )
        for i, p in enumerate(PROMPTS[:2])
    ]
    for t in running:
        t.start()
    assert all(e.wait(30) for e in started)
    assert not _idle(ctl)  # the update arrives while both run
    init, update = _trainer(ctl, root / "b" / "model.safetensors", "b-dist")
    assert init["success"] is True, init
    assert update["success"] is True, update
    for t in running:
        t.join(60)
    # the requests in flight finished (not aborted) on the old weights
    for c in chunks:
        assert c[-1]["meta_info"]["finish_reason"]["type"] == "length", c[-1]
        assert len(c[-1]["output_ids"]) == RUNNING["max_new_tokens"]
        assert c[-1]["meta_info"]["weight_version"] == "default"
    out = _outputs(ctl)
    assert [o["output_ids"] for o in out] == static_b
    assert out[0]["meta_info"]["weight_version"] == "b-dist"
    # a later switch reshards the new weights as it does the old
    r = ctl.post("/v1/reconfigure", {"layout": "1x2"}, timeout=120)
    assert r.status_code == 200 and r.json()["layout"] == "1x2", r.text
    assert [o["output_ids"] for o in _outputs(ctl)] == static_b
    assert ctl.post("/destroy_weights_update_group", {"group_name": "trainer_group"}).json()["success"]
    assert ctl.get("/health").status_code == 200


def test_a_trainer_broadcasts_a_flattened_bucket(ctl: Served, root: Path) -> None:
    """``load_format: "flattened_bucket"``: one broadcast of every tensor's bytes (SGLang's current bucket);
    outputs then equal a disk load of the same checkpoint."""
    assert ctl.post("/update_weights_from_disk", {"model_path": str(root / "a")}).status_code == 200
    from_disk = [o["output_ids"] for o in _outputs(ctl)]
    assert ctl.post("/update_weights_from_disk", {"model_path": str(root / "b")}).status_code == 200
    assert [o["output_ids"] for o in _outputs(ctl)] != from_disk
    init, update = _trainer(ctl, root / "a" / "model.safetensors", "a-bucket", "flattened_bucket")
    assert init["success"] is True and update["success"] is True, (init, update)
    out = _outputs(ctl)
    assert [o["output_ids"] for o in out] == from_disk and out[0]["meta_info"]["weight_version"] == "a-bucket"
    assert ctl.post("/destroy_weights_update_group", {"group_name": "trainer_group"}).json()["success"]


class _Impostor:
    """A TCP listener on loopback that is no trainer: it accepts every connection, then says nothing
    (``reply`` empty) or sends ``reply`` and nothing more. Closing it closes every connection."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.conns: list[socket.socket] = []

    def __enter__(self) -> int:
        threading.Thread(target=self._accept, daemon=True).start()
        port: int = self.sock.getsockname()[1]
        return port

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.conns.append(conn)
            if self.reply:
                conn.sendall(self.reply)

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _joining(s: Served, name: str) -> dict[str, Any] | None:
    """/health's body while it shows the join of ``name`` under way (the engine serving meanwhile)."""
    r = s.get("/health")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    joins = body.get("joining_weight_update_groups", [])
    return body if any(j["group_name"] == name for j in joins) else None


GARBAGE = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nnope" + bytes(range(256))


def _join_an_impostor(s: Served, reply: bytes, name: str, reference: list[list[int]]) -> None:
    with _Impostor(reply) as port:
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": name,
            "backend": "gloo",
            "timeout": 20,
        }
        answer: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: answer.append(s.post("/init_weights_update_group", body, timeout=120))
        )
        t.start()
        health = wait_until(lambda: _joining(s, name), what=f"/health to show the join of {name}")
        assert health["status"] == "ready" and f"127.0.0.1:{port}" in health["message"], health
        assert [o["output_ids"] for o in _outputs(s)] == reference  # generation goes on ...
        assert _joining(s, name), "the join ended before generation was checked"  # ... during the join
        names = {"names": ["model.norm.weight"], "dtypes": ["float64"], "shapes": [[128]], "group_name": name}
        r = s.post("/update_weights_from_distributed", names)  # not usable while being joined
        assert r.status_code == 409 and r.json()["error"]["field"] == "group_name", r.text
        t.join(120)
        assert answer, f"no answer to the join of {name}"
        assert answer[0].status_code == 400, answer[0].text
        error = answer[0].json()["error"]
        assert error["field"] == "master_address" and f"127.0.0.1:{port}" in error["message"], error


@pytest.mark.long
def test_a_join_that_meets_no_trainer_stalls_nothing(ctl: Served, root: Path) -> None:
    """``/init_weights_update_group`` pointed at a listener that is not a trainer (it accepts and says
    nothing, or answers garbage): the ranks wait for it beside their step loops, so generation goes on and
    ``/health`` says 200 with the join under way; the join fails within its own ``timeout`` as a 400 naming
    ``master_address``, and the name is free again. A real trainer then joins and sends its weights."""
    reference = [o["output_ids"] for o in _outputs(ctl)]
    for reply, name in ((b"", "impostor-silent"), (GARBAGE, "impostor-garbage")):
        _join_an_impostor(ctl, reply, name, reference)
        assert _joining(ctl, name) is None
        r = ctl.post("/destroy_weights_update_group", {"group_name": name})  # never joined: unknown
        assert r.status_code == 400 and r.json()["error"]["field"] == "group_name", r.text
    init, update = _trainer(ctl, root / "b" / "model.safetensors", "b-after-impostors")
    assert init["success"] is True and update["success"] is True, (init, update)
    assert [o["output_ids"] for o in _outputs(ctl)] == _static(root / "b", PROMPTS)
    assert ctl.post("/destroy_weights_update_group", {"group_name": "trainer_group"}).json()["success"]
    assert ctl.get("/health").status_code == 200


def test_bad_weight_sync_bodies_name_the_field(ctl: Served) -> None:
    init = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "g",
        "backend": "gloo",
    }
    name = "model.norm.weight"
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("/init_weights_update_group", {**init, "world_size": 2}, 400, "world_size"),
        ("/init_weights_update_group", {**init, "backend": "nccl"}, 400, "backend"),
        ("/init_weights_update_group", {**init, "backend": "mpi"}, 400, "backend"),
        ("/init_weights_update_group", {**init, "master_port": 0}, 400, "master_port"),
        # no trainer listens (port 1) or no such host: refused before any rank waits for it (found by
        # test_hardening's schemathesis, whose case stalled the engine for the join's 300 s)
        ("/init_weights_update_group", init, 400, "master_address"),
        ("/init_weights_update_group", {**init, "master_address": "no such host"}, 400, "master_address"),
        (
            "/update_weights_from_distributed",
            {"names": [name], "dtypes": ["float64"], "shapes": [[1]]},
            400,
            "group_name",
        ),
        ("/destroy_weights_update_group", {"group_name": "nope"}, 400, "group_name"),
        (  # SGLang reads null and flattened_bucket here (it ignores any other value); refused, not ignored
            "/update_weights_from_distributed",
            {"names": [name], "dtypes": ["float64"], "shapes": [[1]], "load_format": "direct"},
            400,
            "load_format",
        ),
    ]
    for path, body, status, field in cases:
        r = ctl.post(path, body)
        assert r.status_code == status and field in r.text, (path, body, r.text)
    assert ctl.get("/health").status_code == 200


def test_announced_tensors_are_checked_against_the_model(root: Path) -> None:
    cfg = ModelConfig.load(root / "a")
    shapes = dict(tensor_shapes(cfg))
    name = "model.norm.weight"
    good = list(shapes[name])
    assert check_announced([name], ["torch.float32"], [good], cfg) == ["float32"]
    cases: list[tuple[list[str], list[str], list[list[int]], str]] = [
        ([name], ["float64", "float64"], [good], "names"),
        (["no.such.tensor"], ["float64"], [good], "names.0"),
        ([name, name], ["float64"] * 2, [good] * 2, "names.1"),
        ([name], ["float64"], [[good[0] + 1]], "shapes.0"),
        ([name], ["int64"], [good], "dtypes.0"),
    ]
    for names, dtypes, shp, field in cases:
        with pytest.raises(UserError) as err:
            check_announced(names, dtypes, shp, cfg)
        assert err.value.field == field, (names, dtypes, shp)
