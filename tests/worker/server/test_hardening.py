"""A server as a hostile client meets it (issue 15): a body shorter than its Content-Length, the key on
/health_generate, weight paths outside the root, and schemathesis over the whole OpenAPI (no 5xx, every 4xx
in the error schema). One small server: 1 rank, a short context, a 1 s body timeout, an API key."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.worker.server.served import Served, start
from tests.worker.web.fuzz import fuzz

pytestmark = pytest.mark.multiproc
KEY = "hardening-key"


@pytest.fixture(scope="module")
def guarded(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("hard")
    s = start(tiny64, tmp, "--context-length", "32", "--body-timeout-seconds", "1", key=KEY)
    yield s
    s.stop()


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closes(guarded: Served) -> None:
    url = urlsplit(guarded.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        head = (
            "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"text": "a"')
        got = b""
        while chunk := sock.recv(65536):  # until the server closes (a socket timeout fails the test)
            got += chunk
    status, _, rest = got.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), got
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == 408 and "not received within 1 s" in body["error"]["message"]


def test_health_generate_needs_the_key(guarded: Served) -> None:
    assert httpx.get(guarded.url + "/health_generate", timeout=60).status_code == 401
    assert guarded.get("/health_generate").status_code == 200
    assert httpx.get(guarded.url + "/health", timeout=60).status_code == 200  # still open


def test_the_weights_root_is_the_model_directory_and_outside_it_every_path_looks_alike(
    guarded: Served, tiny64: Path, tmp_path: Path
) -> None:
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny64 / "config.json", no_weights / "config.json")
    outside = [str(tiny64.parent), str(tmp_path / "missing"), str(tmp_path), str(no_weights)]
    answers = []
    for path in outside:  # the model's parent was the root before
        r = guarded.post("/update_weights_from_disk", {"model_path": path})
        assert r.status_code == 403 and r.json()["error"]["field"] == "model_path", r.text
        assert str(tiny64.parent) not in r.text.replace(path, "PATH"), r.text  # the root is not echoed
        answers.append(r.text.replace(path, "PATH"))
    assert len(set(answers)) == 1, answers
    r = guarded.post("/update_weights_from_disk", {"model_path": str(tiny64 / "sub")})  # inside: told
    assert r.status_code == 400 and "config.json" in r.json()["error"]["message"]


def test_schemathesis_finds_no_5xx_and_every_4xx_is_an_error_body(guarded: Served) -> None:
    undo = {
        "/pause_generation": "/continue_generation",
        "/release_memory_occupation": "/resume_memory_occupation",
    }

    def reset(path: str) -> None:  # a paused or released engine would make the next cases wait or fail
        if path in undo:
            assert guarded.post(undo[path], {}).status_code == 200

    spec = guarded.get("/openapi.json").json()
    operations = sum(len(ops) for ops in spec["paths"].values())
    assert fuzz(guarded.url, guarded.headers, after=reset, max_examples=5) == operations
