"""Jobs the schema accepts but the operator cannot run are refused by the operator: phase Failed, a Failed
condition (reason InvalidSpec) naming the field, a Warning Event, and nothing made for them (no Secret, no
Service, no pod). And two operators with kopf peering: only the one with the higher priority acts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.operator.kube.conftest import NS, Cluster, OperatorProcess
from tests.operator.local.jobs import job_doc
from tests.waiting import wait_until

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("no-profile", {"parallelism": {"profile": None}}, "spec.parallelism.profile"),
    ("unknown-profile", {"parallelism": {"profile": "nope.json"}}, "spec.parallelism.profile"),
    ("wrong-devices", {"gpusPerPod": 4, "parallelism": {"initialLayout": "4x1"}}, "spec.parallelism.profile"),
    (
        "no-volume",
        {"pod": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}},
        "spec.pod.volumeMounts[0].name",
    ),
    ("gpu-by-hand", {"pod": {"resources": {"limits": {"nvidia.com/gpu": "1"}}}}, "spec.pod.resources.limits"),
    ("bad-resources", {"pod": {"resources": {"claims": {"a": "b"}}}}, "spec.pod.resources.claims"),
    ("x" * 62, {"pods": 10}, "metadata.name"),
]


def _doc(name: str, tmp: Path, **spec: Any) -> dict[str, Any]:
    doc = job_doc(tmp / "model", tmp / "p.jsonl", tmp / "out", **spec)
    doc["metadata"] = {"name": name}
    return doc


def _refused(c: Cluster, name: str) -> dict[str, Any]:
    st = c.status(name)
    failed = [x for x in st.get("conditions") or [] if x["type"] == "Failed" and x["status"] == "True"]
    return failed[0] if st.get("phase") == "Failed" and failed else {}


def _absent(read: Any, *args: str) -> bool:
    try:
        read(*args)
    except ApiException as exc:
        return exc.status == 404
    return False


def _count(peers: dict[str, Any], n: int) -> dict[str, Any] | None:
    return peers if len(peers) == n else None


def test_jobs_the_operator_cannot_run_are_refused_naming_the_field(cluster: Cluster, tmp_path: Path) -> None:
    op = cluster.start_operator()
    for name, spec, _ in REFUSED:
        cluster.create_job(_doc(name, tmp_path, **spec))
    for name, _, field in REFUSED:
        cond = wait_until(
            lambda n=name: _refused(cluster, n),
            what=f"{name} refused",
            timeout=30,
            explain=cluster.explain(name),
        )
        assert cond["reason"] == "InvalidSpec" and cond["message"].startswith(f"{field}:"), (name, cond)
        events = cluster.events(name)
        assert any(r == "InvalidSpec" and m.startswith(field) for r, m in events), (name, events)
        assert _absent(cluster.core.read_namespaced_secret, f"{name}-token", NS), name
        assert _absent(cluster.core.read_namespaced_service, name, NS), name
        assert not cluster.pods(name), name
    assert op.metric("rollout_operator_jobs_refused_total") == len(REFUSED)
    assert op.metric("rollout_operator_pods_created_total") == 0
    assert op.stop() == 0, op.tail()  # SIGTERM, as Kubernetes stops it: a clean exit


def test_two_operators_with_peering_only_one_acts(cluster: Cluster, tmp_path: Path) -> None:
    """As two replicas of the chart's Deployment: the same settings, no priority (each draws its own)."""
    peering = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "elastic-rollout"}}
    cluster.custom.create_namespaced_custom_object("kopf.dev", "v1", NS, "kopfpeerings", peering)

    def peers() -> dict[str, dict[str, Any]]:  # kopf's identity -> {priority, lastseen, lifetime}
        got = cluster.custom.get_namespaced_custom_object(
            "kopf.dev", "v1", NS, "kopfpeerings", "elastic-rollout"
        )
        return dict(got.get("status") or {})

    ops: list[OperatorProcess] = []
    ids: list[str] = []
    for i in (0, 1):  # each replica once the one before has announced itself, as a rolling Deployment
        ops.append(cluster.start_operator(f"replica-{i}", peering="elastic-rollout"))
        seen = wait_until(lambda n=i + 1: _count(peers(), n), what=f"replica {i} in the peering object")
        ids += [x for x in seen if x not in ids]
    first, second = (seen[x]["priority"] for x in ids)
    # kopf starts a peering operator paused and resumes it (a log line) once no live peer outranks it. So a
    # second replica that is outranked never acts; a first one that is outranked has acted alone until now,
    # and is settled once it has read the second's keep-alive and paused (a log line) before any job comes.
    if second > first:
        wait_until(
            lambda: "Pausing operations in favour of" in ops[0].log.read_text(),
            what="replica 0 to pause in favour of replica 1",
            explain=ops[0].tail,
        )
    names = [f"peer-{i}" for i in range(3)]
    for name in names:
        cluster.create_job(_doc(name, tmp_path, parallelism={"profile": None}))
    for name in names:
        wait_until(
            lambda n=name: _refused(cluster, n),
            what=f"{name} refused",
            timeout=60,
            explain=cluster.explain(name),
        )
    refused = sorted(op.metric("rollout_operator_jobs_refused_total") for op in ops)
    assert refused == [0, len(names)], refused
    idle = min(ops, key=lambda op: op.metric("rollout_operator_jobs_refused_total"))
    assert idle.metric("rollout_operator_tick_seconds_count") == 0  # paused: not even its timers run
