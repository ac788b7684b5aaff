"""Starting ``rolloutctl serve`` as a child process and waiting until it serves (benchmarks and tests)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from rollout_worker.proc import StartFailed, free_port, rolloutctl, spawn, stop, wait_healthy


def start_server(
    model: Path, args: list[str], log: Path, port: int | None = None, timeout_s: float = 300.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server with ``args`` (after --model/--port), output to ``log``; return once /health is 200.
    Raises StartFailed (with the log's tail) if it exits or does not become healthy in time. Call it where
    no event loop runs (it runs one while waiting)."""
    port = port or free_port()
    argv = [*rolloutctl(), "serve", "--model", str(model), "--port", str(port), *args]
    child = spawn("server", argv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_healthy({"server": [url + "/health"]}, [child], timeout_s))
    except StartFailed as exc:
        if not child.exited:  # not healthy in time
            child.proc.kill()
            child.proc.wait(timeout=10)
            raise StartFailed(f"{exc}:\n{child.tail(40)}") from None
        raise
    return child.proc, url


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
    stop([proc], timeout_s)
    return int(proc.returncode)
