"""Starting ``rolloutctl serve`` as a child process and waiting until it serves (benchmarks, tests,
and later the pod runtime use this)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerFailed(RuntimeError):
    pass


def start_server(
    model: Path, args: list[str], log: Path, port: int | None = None, timeout_s: float = 300.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server with ``args`` (after --model/--port), output to ``log``; return once /health is 200.
    Raises ServerFailed (with the log's tail) if it exits or does not become healthy in time."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "rollout_operator.cli.main",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        *args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=10)
    raise ServerFailed(f"server not healthy after {timeout_s:.0f} s:\n{_tail(log)}")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    return proc.returncode


def _tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
