"""The pod status a kubelet reports, computed from LocalKubelet's view of a pod's processes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tests.k8s.store import now

if TYPE_CHECKING:
    from tests.k8s.kubelet import Container, Pod


def _state(pod: Pod, c: Container) -> dict[str, Any]:
    if c.exit_code is not None:
        reason = "Completed" if c.exit_code == 0 else "Error"
        return {
            "terminated": {
                "exitCode": c.exit_code,
                "reason": reason,
                "startedAt": c.started_at or None,
                "finishedAt": c.finished_at,
            }
        }
    if c.proc is not None:
        return {"running": {"startedAt": c.started_at}}
    if pod.config_error:
        return {"waiting": {"reason": "CreateContainerConfigError", "message": pod.config_error}}
    return {"waiting": {"reason": "ContainerCreating"}}


def _container_status(pod: Pod, c: Container) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": c.spec["name"],
        "image": c.spec.get("image", ""),
        "imageID": "",
        "ready": c.ready and c.exit_code is None and c.proc is not None,
        "started": c.proc is not None and c.exit_code is None,
        "restartCount": c.restarts,
        "state": _state(pod, c),
    }
    if c.proc is not None:
        out["containerID"] = f"local://{c.proc.pid}"
    if c.last is not None:
        out["lastState"] = {"terminated": c.last}
    return out


def _phase(pod: Pod) -> str:
    containers = list(pod.containers.values())
    if pod.failure:
        return "Failed"
    if containers and all(c.exit_code is not None for c in containers):
        return "Succeeded" if all(c.exit_code == 0 for c in containers) else "Failed"
    if any(c.proc is not None for c in containers):
        return "Running"
    return "Pending"


def pod_status(pod: Pod, node: str) -> dict[str, Any]:
    statuses = [_container_status(pod, c) for c in pod.containers.values()]
    phase = _phase(pod)
    ready = phase == "Running" and all(s["ready"] for s in statuses)
    started = any(c.proc is not None for c in pod.containers.values())
    conds = {"PodScheduled": True, "Initialized": True, "ContainersReady": ready, "Ready": ready}
    conditions = []
    for kind, value in conds.items():
        text = "True" if value else "False"
        if pod.transitions.get(kind, ("", ""))[0] != text:
            pod.transitions[kind] = (text, now())
        condition = {"type": kind, "status": text, "lastTransitionTime": pod.transitions[kind][1]}
        if not value:
            condition["reason"] = "PodFailed" if phase == "Failed" else "ContainersNotReady"
        conditions.append(condition)
    status: dict[str, Any] = {
        "phase": phase,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": pod.ip,
        "podIPs": [{"ip": pod.ip}],
        "qosClass": "BestEffort",
        "conditions": conditions,
        "containerStatuses": statuses,
    }
    if started or pod.start_time:
        status["startTime"] = pod.start_time
    if pod.failure:
        status["reason"], status["message"] = "Error", pod.failure
    elif pod.config_error:
        status["message"] = pod.config_error
    return status
