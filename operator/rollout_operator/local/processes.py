"""Starting and stopping a local run's processes. Every child dies with the runner, however the runner dies
(PR_SET_PDEATHSIG, set in the child before it runs; children are started from the main thread, since the
signal follows the thread that forked). Ctrl-C or SIGTERM stops them all: SIGTERM, then SIGKILL."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rollout_worker.api.errors import EngineError

from rollout_operator.local.pods import PodProcesses

CLI = [sys.executable, "-m", "rollout_operator.cli.main"]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@dataclass
class LocalPods:
    pods: list[PodProcesses]
    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*CLI, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                preexec_fn=_die_with_parent,  # started from the main thread only (see the docstring)
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for pod in self.pods:
            self._spawn(f"{pod.name}-engine", ["serve", *pod.engine_args], pod.engine_env)
            self._spawn(f"{pod.name}-sidecar", ["sidecar"], pod.sidecar_env)

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until every engine answers /health and every sidecar /readyz; a child that exits fails the run."""
        deadline = time.monotonic() + timeout_s
        waiting = {p.name: [p.engine_url + "/health", p.api_url + "/readyz"] for p in self.pods}
        async with httpx.AsyncClient(timeout=2.0) as client:
            while waiting:
                for c in self.dead():
                    raise EngineError(
                        f"{c.name} exited with code {c.proc.returncode} while starting:\n{c.tail()}"
                    )
                for name, urls in list(waiting.items()):
                    try:
                        codes = [(await client.get(u)).status_code for u in urls]
                        ok = all(c == 200 for c in codes)
                    except httpx.HTTPError:
                        ok = False
                    if ok:
                        del waiting[name]
                if time.monotonic() > deadline:
                    raise EngineError(f"pods not ready after {timeout_s:.0f} s: {', '.join(waiting)}")
                await asyncio.sleep(0.2)

    def stop(self, grace_s: float = 20.0) -> None:
        alive = [c for c in self.children if c.proc.poll() is None]
        for c in alive:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in alive:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=5)
