"""A real `rolloutctl serve` process on a loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        with self.client() as c:
            return c.get(path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        with self.client(kw.pop("timeout", 60.0)) as c:
            return c.post(path, json=body, **kw)

    def put(self, path: str, body: Any = None) -> httpx.Response:
        with self.client() as c:
            return c.put(path, json=body)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


def start(model: Path, tmp: Path, *args: str, key: str | None = None, timeout: float = 90.0) -> Served:
    """Start the server and wait until /health answers 200 (fails with the server's log otherwise)."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "rollout_operator.cli.main",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
    ]
    if key:
        keyfile = tmp / f"key-{port}"
        keyfile.write_text(key + "\n")
        cmd += ["--api-key-file", str(keyfile)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    served = Served(proc, f"http://127.0.0.1:{port}", log, key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{served.tail()}")
        try:
            if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    served.stop()
    raise AssertionError(f"server not healthy after {timeout} s:\n{served.tail()}")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of children too), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pids: list[int]) -> list[int]:
    """The pids that still exist and are not zombies."""
    left = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.append(p)
    return left
