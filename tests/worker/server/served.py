"""A real `rolloutctl serve` process on a loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rollout_worker.proc import StartFailed, free_port
from rollout_worker.server.process import start_server, stop_server


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
        return stop_server(self.proc)


def start(model: Path, tmp: Path, *args: str, key: str | None = None, timeout: float = 90.0) -> Served:
    """Start the server and wait until /health answers 200 (fails with the server's log otherwise)."""
    port = free_port()
    extra = list(args)
    if key:
        keyfile = tmp / f"key-{port}"
        keyfile.write_text(key + "\n")
        extra += ["--api-key-file", str(keyfile)]
    log = tmp / f"server-{port}.log"
    try:
        proc, url = start_server(model, extra, log, port, timeout)
    except StartFailed as exc:
        raise AssertionError(str(exc)) from None
    return Served(proc, url, log, key)


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


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on (TCP over IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)  # 32-bit words, each in the host's (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((socket.inet_ntop(family, words), int(port, 16)))
    return out
