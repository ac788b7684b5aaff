"""The operator end to end: the Kubernetes API emulator (tests/k8s), the test acting as the kubelet (each
pod's containers as local processes on its own 127.0.0.N), and `rolloutctl operator` as a real process with
a kubeconfig pointing at the emulator. Jobs are made with the official `kubernetes` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from rollout_operator.api import cluster as k
from rollout_operator.cluster import rbac
from rollout_worker.proc import free_port

from tests.k8s.fixtures import emulator, k8s_api, kubelet  # noqa: F401  (fixtures)
from tests.waiting import wait_until

NS = "default"
OPERATOR_AGENTS = ("kopf/", "elastic-rollout-operator")  # kopf's requests and the operator's own


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    metrics: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(15)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on /metrics (0 when it has none yet)."""
        text = httpx.get(self.metrics + "/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


@dataclass
class Cluster:
    api: client.ApiClient
    kubeconfig: Path
    db_url: str
    tmp: Path
    kubelet: Any
    operators: list[OperatorProcess] = field(default_factory=list)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def start_operator(self, name: str = "op", **settings: str) -> OperatorProcess:
        port, health = free_port(), free_port()
        env = os.environ | {
            "KUBECONFIG": str(self.kubeconfig),
            "ROLLOUT_OPERATOR_DATABASE_URL": self.db_url,
            "ROLLOUT_OPERATOR_POD_LISTEN": "pod-ip",
            "ROLLOUT_OPERATOR_TICK_SECONDS": "0.5",
            "ROLLOUT_OPERATOR_SIDECAR_TIMEOUT_SECONDS": "2",
            "ROLLOUT_OPERATOR_DEGRADED_AFTER_SECONDS": "3",
            "ROLLOUT_OPERATOR_METRICS_PORT": str(port),
            "ROLLOUT_OPERATOR_HEALTH_PORT": str(health),
            "ROLLOUT_OPERATOR_PROFILES_DIR": str(Path(__file__).parents[2] / "data"),
            **{f"ROLLOUT_OPERATOR_{key.upper()}": value for key, value in settings.items()},
        }
        log = self.tmp / f"{name}-{len(self.operators)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_operator.cli.main", "operator", "--namespace", NS],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        op = OperatorProcess(proc, log, f"http://127.0.0.1:{port}")
        self.operators.append(op)
        wait_until(
            lambda: _answers(op), what=f"operator {name} serving /metrics", timeout=60, explain=op.tail
        )
        return op

    def create_job(self, doc: dict[str, Any]) -> dict[str, Any]:
        got: dict[str, Any] = self.custom.create_namespaced_custom_object(
            k.GROUP, k.VERSION, NS, k.PLURAL, doc
        )
        return got

    def job(self, name: str) -> dict[str, Any]:
        got: dict[str, Any] = self.custom.get_namespaced_custom_object(k.GROUP, k.VERSION, NS, k.PLURAL, name)
        return got

    def jobs(self) -> list[dict[str, Any]]:
        got = self.custom.list_namespaced_custom_object(k.GROUP, k.VERSION, NS, k.PLURAL)
        return list(got["items"])

    def patch_job(self, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(k.GROUP, k.VERSION, NS, k.PLURAL, name, body)

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def pods(self, job: str) -> list[Any]:
        return [
            p
            for p in self.core.list_namespaced_pod(NS).items
            if (p.metadata.labels or {}).get(k.LABEL_JOB) == job
        ]

    def events(self, job: str) -> list[tuple[str, str]]:
        out = []
        for e in self.core.list_namespaced_event(NS).items:
            if e.involved_object is not None and e.involved_object.name == job:
                out.append((e.reason, e.message or ""))
        return out

    def wait_phase(self, name: str, phase: str, timeout: float = 180.0) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            st = self.status(name)
            return st if st.get("phase") == phase else None

        return wait_until(
            reached, what=f"{name} in phase {phase}", timeout=timeout, explain=self.explain(name)
        )

    def explain(self, name: str) -> Callable[[], str]:
        def text() -> str:
            ops = "\n".join(f"--- {o.log.name}\n{o.tail()}" for o in self.operators)
            try:
                st = self.status(name)
            except Exception as exc:  # the job may be gone
                st = {"error": str(exc)}
            return f"status: {st}\nevents: {self.events(name)}\n{ops}\n{self.kubelet_logs()}"

        return text

    def kubelet_logs(self) -> str:
        out = []
        for f in sorted((self.tmp / "kubelet-logs").rglob("*.log")):
            out.append(f"--- {f.relative_to(self.tmp)}\n{f.read_text()[-1500:]}")
        return "\n".join(out)


def _answers(op: OperatorProcess) -> bool:
    if not op.alive():
        raise AssertionError(f"the operator exited with {op.proc.returncode}:\n{op.tail()}")
    try:
        return httpx.get(op.metrics + "/metrics", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def cluster(emulator: Any, k8s_api: Any, kubelet: Any, tmp_path: Path) -> Iterator[Cluster]:  # noqa: F811
    """The emulator with the kubelet, a database, and the operators this test starts (stopped after it)."""
    c = Cluster(
        k8s_api, Path(os.environ["KUBECONFIG"]), f"sqlite:///{tmp_path / 'operator.db'}", tmp_path, kubelet
    )
    try:
        yield c
    finally:
        for op in c.operators:
            op.stop()
    # least privilege, as the operator used it: each of its requests is one the chart's RBAC grants
    rules = rbac.NAMESPACED + rbac.CLUSTER + rbac.PEERING
    used = {(g, r, v) for ua, v, g, r in emulator.emulator.audit if ua.startswith(OPERATOR_AGENTS)}
    denied = sorted(x for x in used if not rbac.allows(rules, *x))
    assert used and not denied, f"requests the operator's RBAC does not grant: {denied}"
