"""The LocalKubelet runs pods as local processes on 127.0.0.N: env from fieldRef and Secrets, readiness,
failures, deletion."""

from __future__ import annotations

import base64
import functools
import os
import signal
from typing import Any

import httpx
import kubernetes.client
import pytest

from tests.k8s.kubelet import LocalKubelet
from tests.k8s.runner import EmulatorHandle
from tests.waiting import wait_until

SERVER = """
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (os.environ["TOKEN"] + " " + os.environ["GREETING"]).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer((os.environ["POD_IP"], int(os.environ["PORT"])), H).serve_forever()
"""


def web_pod(name: str, restart: str = "Never") -> dict[str, Any]:
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PORT", "value": "8000"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "GREETING", "value": "hi-$(POD_NAME)-$$(X)-$(NOPE)"},
    ]
    env.insert(0, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    container = {
        "name": "web",
        "image": "python",
        "command": ["python", "-c", SERVER],
        "env": env,
        "readinessProbe": {"httpGet": {"path": "/", "port": 8000}, "periodSeconds": 1},
    }
    return {"metadata": {"name": name}, "spec": {"restartPolicy": restart, "containers": [container]}}


def pod_of(emulator: EmulatorHandle, name: str) -> dict[str, Any] | None:
    return emulator.object("pods", name)


def ready(emulator: EmulatorHandle, name: str) -> dict[str, Any] | None:
    pod = pod_of(emulator, name)
    conds = {c["type"]: c["status"] for c in (pod or {}).get("status", {}).get("conditions", [])}
    return pod if conds.get("Ready") == "True" else None


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1].startswith("Z")  # a zombie is dead


@pytest.fixture
def core(k8s_api: kubernetes.client.ApiClient) -> Any:
    api: Any = kubernetes.client.CoreV1Api(k8s_api)
    token = base64.b64encode(b"s3cret").decode()
    api.create_namespaced_secret("default", {"metadata": {"name": "creds"}, "data": {"token": token}})
    return api


def test_a_pod_runs_gets_ready_and_serves(core: Any, kubelet: LocalKubelet, emulator: EmulatorHandle) -> None:
    core.create_namespaced_pod("default", web_pod("web-0"))
    core.create_namespaced_pod("default", web_pod("web-1"))
    pods = [
        wait_until(functools.partial(ready, emulator, n), what=f"{n} to be Ready", timeout=15)
        for n in ("web-0", "web-1")
    ]
    ips = [p["status"]["podIP"] for p in pods]
    assert ips[0] != ips[1] and all(ip.startswith("127.0.0.") for ip in ips), ips
    status = pods[0]["status"]
    assert status["phase"] == "Running" and status["hostIP"] == "127.0.0.1" and status["startTime"]
    (cs,) = status["containerStatuses"]
    assert cs["ready"] and cs["started"] and cs["restartCount"] == 0 and "running" in cs["state"]
    assert pods[0]["spec"]["nodeName"] == "local-node"
    assert httpx.get(f"http://{ips[0]}:8000/").text == "s3cret hi-web-0-$(X)-$(NOPE)"
    assert kubelet.started("web-0") == 1 and kubelet.running() == ["web-0", "web-1"]
    kubelet.pause("web-1", "web")  # unreachable for a while: not Ready, then Ready again
    wait_until(lambda: not ready(emulator, "web-1"), what="web-1 to be unready")
    kubelet.resume("web-1", "web")
    wait_until(lambda: ready(emulator, "web-1"), what="web-1 to be Ready again")


def test_a_crash_fails_the_pod(core: Any, kubelet: LocalKubelet, emulator: EmulatorHandle) -> None:
    core.create_namespaced_pod("default", web_pod("web-0"))
    wait_until(lambda: ready(emulator, "web-0"), what="web-0 to be Ready", timeout=15)
    kubelet.kill("web-0", "web", signal.SIGKILL)
    pod = wait_until(
        lambda: (p := pod_of(emulator, "web-0")) and p["status"]["phase"] == "Failed" and p,
        what="web-0 to fail",
    )
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == -9 and terminated["reason"] == "Error"
    assert "web" in pod["status"]["message"] and "-9" in pod["status"]["message"]


def test_a_restarting_pod_and_a_deleted_one(
    core: Any, kubelet: LocalKubelet, emulator: EmulatorHandle
) -> None:
    core.create_namespaced_pod("default", web_pod("web-0", restart="Always"))
    wait_until(lambda: ready(emulator, "web-0"), what="web-0 to be Ready", timeout=15)
    (pid,) = kubelet.pids("web-0").values()
    kubelet.kill("web-0", "web")
    pod = wait_until(
        lambda: (
            (p := ready(emulator, "web-0")) and p["status"]["containerStatuses"][0]["restartCount"] == 1 and p
        ),
        what="a restart",
        timeout=15,
    )
    assert pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == -9
    (pid,) = kubelet.pids("web-0").values()
    core.delete_namespaced_pod("web-0", "default")
    wait_until(lambda: gone(pid), what="the process to end")
    wait_until(lambda: pod_of(emulator, "web-0") is None, what="the pod to be removed")
    assert kubelet.running() == []


def test_a_missing_secret_keeps_the_pod_pending(
    k8s_api: kubernetes.client.ApiClient, kubelet: LocalKubelet, emulator: EmulatorHandle
) -> None:
    core: Any = kubernetes.client.CoreV1Api(k8s_api)
    core.create_namespaced_pod("default", web_pod("web-0"))

    def waiting() -> str | None:
        statuses = ((pod_of(emulator, "web-0") or {}).get("status") or {}).get("containerStatuses") or [{}]
        return statuses[0].get("state", {}).get("waiting", {}).get("reason")

    wait_until(lambda: waiting() == "CreateContainerConfigError", what="the container to wait on its config")
    assert pod_of(emulator, "web-0")["status"]["phase"] == "Pending"  # type: ignore[index]
    token = base64.b64encode(b"late").decode()
    core.create_namespaced_secret("default", {"metadata": {"name": "creds"}, "data": {"token": token}})
    pod = wait_until(lambda: ready(emulator, "web-0"), what="web-0 to be Ready", timeout=15)
    assert httpx.get(f"http://{pod['status']['podIP']}:8000/").text.startswith("late ")
