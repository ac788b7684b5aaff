"""Starting and stopping a local run's processes. Every child dies with the runner, however the runner dies
(:func:`rollout_worker.proc.die_with_parent`; children are started from the main thread, since the signal
follows the thread that forked). Ctrl-C or SIGTERM stops them all: SIGTERM, then SIGKILL."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rollout_worker.proc import Child, rolloutctl, spawn, stop, wait_healthy

from rollout_operator.local.pods import PodProcesses


@dataclass
class LocalPods:
    pods: list[PodProcesses]
    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = self.log_dir / f"{name}.log"
        # started from the main thread only (see the docstring)
        self.children.append(spawn(name, [*rolloutctl(), *args], log, env, with_parent=True))

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for pod in self.pods:
            self._spawn(f"{pod.name}-engine", ["serve", *pod.engine_args], pod.engine_env)
            self._spawn(f"{pod.name}-sidecar", ["sidecar"], pod.sidecar_env)

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.exited]

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until every engine answers /health and every sidecar /readyz; a child that exits fails the run."""
        urls = {p.name: [p.engine_url + "/health", p.api_url + "/readyz"] for p in self.pods}
        await wait_healthy(urls, self.children, timeout_s)

    def stop(self, grace_s: float = 20.0) -> None:
        stop([c.proc for c in self.children], grace_s)
