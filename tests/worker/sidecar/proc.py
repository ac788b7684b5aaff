"""A real `rolloutctl sidecar` process on loopback ports, for the sidecar tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rollout_worker.proc import free_port
from rollout_worker.sidecar.settings import settings_env

from tests.worker.server.served import Served

TOKEN = "sidecar-token"


@dataclass
class SidecarProc:
    proc: subprocess.Popen[bytes]
    api: str
    admin: str
    log: Path
    token: str = TOKEN

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.api + path, headers=self.headers, timeout=30, **kw)

    def json(self, path: str, **kw: Any) -> Any:
        r = self.get(path, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def admin_call(self, method: str, path: str, body: Any) -> httpx.Response:
        return httpx.request(method, self.admin + path, headers=self.headers, json=body, timeout=60)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"sidecar still running after {timeout} s:\n{self.tail()}") from None

    def stop(self) -> int:
        """SIGTERM; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def sidecar_env(engine: Served | None, tmp: Path, **fields: Any) -> dict[str, str]:
    keyfile = tmp / "sidecar.key"
    keyfile.write_text(TOKEN + "\n")
    base: dict[str, Any] = {"token_file": keyfile, "poll_seconds": 0.2, "retry_seconds": 0.1}
    if engine is not None:
        base["engine_url"] = engine.url
        if engine.key:
            ekey = tmp / "engine.key"
            ekey.write_text(engine.key)
            base["engine_key_file"] = ekey
    return settings_env(**{**base, **fields})


def start_sidecar(
    env: dict[str, str], log: Path, ready: bool = True, may_exit: bool = False, timeout: float = 60.0
) -> SidecarProc:
    """Start `rolloutctl sidecar` with ``env`` (ports chosen here) and wait for /readyz (or /healthz when
    not ``ready``); with ``may_exit``, a sidecar that exits first is returned as it is."""
    port, admin = free_port(), free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_SIDECAR_")}
    full = {
        **clean,
        **env,
        "ROLLOUT_SIDECAR_PORT": str(port),
        "ROLLOUT_SIDECAR_ADMIN_PORT": str(admin),
        "PYTHONUNBUFFERED": "1",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_operator.cli.main", "sidecar"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full,
        )
    side = SidecarProc(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", log)
    path = "/readyz" if ready else "/healthz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if may_exit:
                return side
            raise AssertionError(f"sidecar exited with {proc.returncode}:\n{side.tail()}")
        try:
            if httpx.get(side.api + path, timeout=2).status_code == 200:
                return side
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    side.kill()
    raise AssertionError(f"sidecar not {path} after {timeout} s:\n{side.tail()}")


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]
