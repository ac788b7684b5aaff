"""`rolloutctl serve` on a port it cannot listen on: exit 2 at once with one line naming the flag, no rank
started, no process left (it used to start the ranks first, then hang in its shutdown, deaf to SIGINT and
SIGTERM). A bad host takes the same path (tests/worker/test_proc.py: ``listen``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.waiting import wait_until
from tests.worker.server.served import alive, descendants

LIMIT_S = 30.0  # the CLI's start; the old code took longer (it started the ranks first), or never ended


def test_serve_on_a_taken_port_exits_2_at_once_leaving_no_process(tiny64: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        argv = [
            sys.executable,
            "-m",
            "rollout_operator.cli.main",
            "serve",
            "--model",
            str(tiny64),
            "--port",
            port,
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen: set[int] = set()

        def exited() -> bool:
            seen.update(descendants(proc.pid))
            return proc.poll() is not None

        try:
            wait_until(exited, what="serve to exit", timeout=LIMIT_S)
        finally:
            left = alive(sorted(seen | set(descendants(proc.pid))))
            for pid in left:  # only when failing: leave nothing behind either
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            _, err = proc.communicate(timeout=10)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --port: cannot listen on "), err
    assert port in lines[0] and "Address already in use" in lines[0]
    assert not left, f"children of the server outlived it: {left}"
