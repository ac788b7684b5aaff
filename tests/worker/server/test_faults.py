"""Faults and signals: a rank killed mid-run (503, every request ends with an abort naming the dead rank,
non-zero exit, nothing left behind); SIGTERM and SIGKILL of the server and of `rolloutctl generate`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.waiting import wait_until
from tests.worker.server.served import Served, alive, descendants, start

pytestmark = pytest.mark.multiproc
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


def _all_gone(pids: list[int], what: str) -> None:
    wait_until(lambda: not alive(pids), what=what, timeout=10, explain=lambda: f"alive: {alive(pids)}")


def _health(s: Served) -> int:
    return httpx.get(s.url + "/health", timeout=2).status_code


def _running_requests(s: Served) -> list[dict[str, Any]]:
    return [r for rep in s.get("/v1/state").json()["replicas"] for r in rep["running"]]


def _running(s: Served) -> int:
    return len(_running_requests(s))


def _decoding(s: Served) -> bool:
    """One request on a replica, with tokens generated."""
    running = _running_requests(s)
    return len(running) == 1 and running[0]["generated"] > 0


def test_a_killed_rank_fails_the_server_cleanly(tiny64: Path, tmp_path: Path) -> None:
    s = start(tiny64, tmp_path, "--ranks", "2", "--dtype", "float64")
    family = descendants(s.proc.pid)
    pids = s.get("/get_server_info").json()["rank_pids"]
    results: list[Any] = []
    chunks: list[Any] = []

    def plain() -> None:
        results.append(
            s.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": LONG}, timeout=60).json()
        )

    def streamed() -> None:
        with (
            s.client() as c,
            c.stream(
                "POST", "/generate", json={"input_ids": [4, 5], "sampling_params": LONG, "stream": True}
            ) as r,
        ):
            chunks.extend(json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {"))

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    wait_until(lambda: len(chunks) >= 3, what="3 streamed chunks", timeout=20)
    # both requests in the engine before the kill (under load the plain one could still be on its way, and
    # then be refused with 503 rather than aborted)
    wait_until(lambda: _running(s) == 2, what="both requests running", timeout=20)
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: _health(s) == 503, what="/health to answer 503", timeout=5)
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a client hangs"
    for finish in [results[0]["meta_info"]["finish_reason"], chunks[-1]["meta_info"]["finish_reason"]]:
        assert finish["type"] == "abort" and "rank 1" in finish["message"], finish
    assert s.proc.wait(timeout=20) != 0
    _all_gone(family, "every process of the server to end")


def test_sigterm_of_the_server_leaves_nothing(tiny64: Path, tmp_path: Path) -> None:
    s = start(tiny64, tmp_path, "--ranks", "2")
    family = descendants(s.proc.pid)
    assert len(family) >= 3  # forkserver, resource tracker, ranks
    out: list[Any] = []
    t = threading.Thread(
        target=lambda: out.append(
            s.post("/generate", {"input_ids": [1], "sampling_params": LONG}, timeout=60).json()
        )
    )
    t.start()
    wait_until(lambda: _decoding(s), what="the request to decode")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=20) == 0
    t.join(10)
    assert out and out[0]["meta_info"]["finish_reason"]["type"] == "abort"  # aborted, answered, not dropped
    _all_gone(family, "every process of the server to end")


def test_sigkill_of_the_server_leaves_nothing(tiny64: Path, tmp_path: Path) -> None:
    s = start(tiny64, tmp_path, "--ranks", "2")
    family = descendants(s.proc.pid)
    s.proc.kill()
    s.proc.wait(timeout=5)
    _all_gone(family, "every process of the server to end")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signals_to_generate_leave_nothing(tiny64: Path, tmp_path: Path, sig: int) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "input_ids": [i + 1, 2],
                    "max_new_tokens": 6 if i < 2 else 1500,
                    "ignore_eos": True,
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_operator.cli.main",
            "generate",
            "--model",
            str(tiny64),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--ranks",
            "2",
            "--log-every",
            "0.2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # wait until it generates
        if line.startswith("step "):
            break
    family = descendants(proc.pid)
    assert len(family) >= 3
    proc.send_signal(sig)
    rest = proc.stderr.read()
    code = proc.wait(timeout=20)
    _all_gone(family, "every process of generate to end")
    assert not out.exists()
    if sig == signal.SIGTERM:
        assert code == 130 and "interrupted: 2 of 6 request(s) had finished" in rest, rest
        assert "were lost" in rest and len((tmp_path / "out.jsonl.partial").read_text().splitlines()) == 2
