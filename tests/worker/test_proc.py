"""rollout_worker.proc: die with the parent, end with another process, spawn and wait until healthy, a free
port, the rolloutctl entry point."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rollout_worker import proc
from rollout_worker.proc import StartFailed, free_port, spawn, stop, wait_healthy, when_gone

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _ended_within(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (our child or not) ends within ``timeout_s`` (a bound, not a timing)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


def test_a_child_started_with_its_parent_ends_when_the_parent_is_sigkilled(tmp_path: Path) -> None:
    parent_code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from rollout_worker.proc import spawn\n"
        f"c = spawn('sleeper', {SLEEPER!r}, Path({str(tmp_path / 'child.log')!r}), with_parent=True)\n"
        "print(c.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _ended_within(child, 0)
    finally:
        parent.kill()  # SIGKILL: the parent cleans nothing up
        parent.wait(10)
    if not _ended_within(child, 30):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its SIGKILLed parent")


def test_when_gone_calls_back_once_the_process_ends_and_at_once_when_it_is_gone() -> None:
    p = subprocess.Popen(SLEEPER)
    ended = threading.Event()
    when_gone(p.pid, ended.set)
    assert not ended.is_set()
    p.kill()
    p.wait(10)
    assert ended.wait(30)
    called: list[bool] = []
    when_gone(p.pid, lambda: called.append(True))  # reaped: gone already, called before returning
    assert called == [True]


def test_free_port_is_a_bindable_loopback_port() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_wait_healthy_names_what_is_not_ready_after_the_timeout(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/health"  # nothing listens there
    with pytest.raises(StartFailed, match=r"^pod-0 not ready after 1 s$"):
        asyncio.run(wait_healthy({"pod-0": [url]}, [], timeout_s=1, interval_s=0.05))


def test_wait_healthy_fails_with_the_log_of_a_child_that_exits(tmp_path: Path) -> None:
    code = "import sys; print('no model here'); sys.exit(3)"
    child = spawn("pod-0-engine", [sys.executable, "-c", code], tmp_path / "engine.log")
    url = f"http://127.0.0.1:{free_port()}/health"
    message = r"^pod-0-engine exited with code 3 while starting:\nno model here$"
    with pytest.raises(StartFailed, match=message):
        asyncio.run(wait_healthy({"pod-0": [url]}, [child], timeout_s=120, interval_s=0.05))


def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
    stop([p], grace_s=0.5)
    assert p.returncode == -signal.SIGKILL


def test_rolloutctl_is_the_console_script_next_to_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert proc.rolloutctl() == [str(Path(sys.executable).parent / "rolloutctl")]
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(StartFailed, match=f"rolloutctl not found at {tmp_path / 'rolloutctl'}"):
        proc.rolloutctl()


def test_rendezvous_ports_are_free_and_outside_the_kernels_ephemeral_range() -> None:
    from rollout_worker.proc import RENDEZVOUS_PORTS, rendezvous_port

    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert RENDEZVOUS_PORTS.stop <= lo or RENDEZVOUS_PORTS.start > hi  # free_port can never hand one out
    ports = {rendezvous_port() for _ in range(20)}
    assert all(p in RENDEZVOUS_PORTS for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("host", "field", "why"),
    [
        ("999.1.1.1", "host", "Name or service not known"),
        ("192.0.2.1", "host", "Cannot assign requested address"),  # TEST-NET-1: no address of this machine
        ("127.0.0.1", "port", "Address already in use"),
    ],
    ids=["unresolvable-host", "foreign-host", "taken-port"],
)
def test_listen_names_the_host_or_the_port_it_cannot_listen_on(host: str, field: str, why: str) -> None:
    from rollout_worker.errors import UserError
    from rollout_worker.proc import listen

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UserError) as err:
            listen(host, port)
    assert err.value.field == field and err.value.message == f"cannot listen on {host}:{port}: {why}"


def test_listen_gives_a_listening_socket() -> None:
    from rollout_worker.proc import listen

    with listen("127.0.0.1", 0) as s, socket.create_connection(s.getsockname()[:2], timeout=5):
        assert s.accept()[0] is not None
