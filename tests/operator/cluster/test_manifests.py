"""The operator's pure parts before anything reaches a cluster: the checks beyond the schema and the pod plan
(tables), and the manifests each job gets (owner, labels, secrets as env, GPU limits, Kueue)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from rollout_operator.api import cluster as k
from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.cluster.manifests import JobRef, PodPlan, build_pod, build_secret, build_service
from rollout_operator.cluster.plan import Refusal, check_cluster_fields, parse_spec, plan_pods
from rollout_profiler.profile import Profile
from rollout_worker.scheduling.layout import Layout
from rollout_worker.sidecar.settings import SidecarFields

PROFILE = Profile.from_json(Path(__file__).parents[2] / "data" / "tiny-2rank-tp2-pays.json")
JOB = JobRef("rl", "team-a", "uid-1", {k.KUEUE_QUEUE: "gpu-queue"})


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"path": "/models/tiny"},
        "gpusPerPod": 2,
        "pods": 2,
        "prompts": {"path": "/data/p.jsonl"},
        "output": {"path": "/out"},
        "parallelism": {"profile": "tiny-2rank-tp2-pays"},
    }
    for key, value in over.items():
        base[key] = value if not isinstance(value, dict) else base.get(key, {}) | value
    return base


def parsed(**over: Any) -> RolloutJobSpec:
    got = parse_spec(spec(**over))
    assert isinstance(got, RolloutJobSpec), got
    return got


REFUSED = [
    ({"gpusPerPod": 3, "parallelism": {"candidates": ["2x1"]}}, None, "spec.parallelism.candidates[0]"),
    (
        {"parallelism": {"initialLayout": "1x2", "candidates": ["2x1"]}},
        None,
        "spec.parallelism.initialLayout",
    ),
    ({"mode": "job", "prompts": None}, None, "spec.prompts"),
    (
        {"pod": {"volumeMounts": [{"name": "models", "mountPath": "/models"}]}},
        None,
        "spec.pod.volumeMounts[0].name",
    ),
    ({"pod": {"resources": {"limits": {"nvidia.com/gpu": "8"}}}}, None, "spec.pod.resources.limits"),
    ({"pod": {"resources": {"claims": {}}}}, None, "spec.pod.resources.claims"),
    ({"pods": 12}, "x" * 61, "metadata.name"),
    ({"parallelism": {"profile": None}}, None, "spec.parallelism.profile"),  # adaptive needs one
    (
        {"gpusPerPod": 4, "parallelism": {"profile": "p"}},
        None,
        "spec.parallelism.profile",
    ),  # 2-device profile
    ({"parallelism": {"candidates": ["2x1", "1x2"], "initialLayout": "1x2"}, "gpusPerPod": 2}, None, None),
]


@pytest.mark.parametrize(("over", "name", "field"), REFUSED)
def test_checks_beyond_the_schema_name_the_field(
    over: dict[str, Any], name: str | None, field: str | None
) -> None:
    got: Any = parse_spec(spec(**over))
    if not isinstance(got, Refusal):
        got = check_cluster_fields(name or "rl", got) or plan_pods(
            got, PROFILE if got.parallelism.profile else None
        )
    if field is None:
        assert isinstance(got, tuple) and isinstance(got[0], PodPlan), got
    else:
        assert isinstance(got, Refusal) and got.field == field, got


def test_the_plan_takes_the_profiles_layouts_and_the_planners_start() -> None:
    got = plan_pods(parsed(), PROFILE)
    assert isinstance(got, tuple)
    plan, job = got
    assert plan.candidates == (Layout(2, 1), Layout(1, 2)) and plan.layout == job.layout
    assert job.policy.candidates == plan.candidates
    assert plan.costs is not None and plan.costs == PROFILE.costs
    static = plan_pods(parsed(parallelism={"policy": "static", "profile": None}), None)
    assert isinstance(static, tuple)
    assert static[0].candidates == (Layout(2, 1),) and static[0].costs is None
    assert static[1].policy.candidates == (Layout(2, 1),)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_pod_runs_the_engine_and_the_sidecar_with_the_jobs_settings() -> None:
    s = parsed(engine={"device": "cuda"}, pod={"image": "reg/er:1"})
    got = plan_pods(s, PROFILE, "pod-ip")
    assert isinstance(got, tuple)
    pod = build_pod(JOB, s, 1, got[0])
    meta, body = pod["metadata"], pod["spec"]
    assert meta["name"] == "rl-1" and meta["namespace"] == "team-a"
    assert meta["ownerReferences"] == [JOB.owner()] and JOB.owner()["controller"] is True
    assert meta["labels"][k.LABEL_JOB] == "rl" and meta["labels"][k.LABEL_POD_INDEX] == "1"
    assert meta["labels"][k.KUEUE_QUEUE] == "gpu-queue" and meta["labels"][k.KUEUE_POD_GROUP] == "rl"
    assert meta["annotations"][k.KUEUE_POD_GROUP_TOTAL] == "2"
    assert body["restartPolicy"] == "Never" and body["subdomain"] == "rl"
    engine, sidecar = body["containers"]
    assert engine["command"] == ["rolloutctl"] and engine["args"][0] == "serve"
    args = engine["args"]
    assert args[args.index("--layout") + 1] == "2x1" and args[args.index("--candidates") + 1] == "2x1,1x2"
    assert args[args.index("--host") + 1] == "$(ROLLOUT_LISTEN)" and "--api-key-file" not in args
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2" and engine["image"] == "reg/er:1"
    env = _env(engine)
    assert env["ROLLOUT_LISTEN"] == "$(POD_IP)" and env["POD_IP"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    assert env["ROLLOUT_API_KEY"] == {"secretKeyRef": {"name": "rl-token", "key": k.SECRET_ENGINE_KEY}}
    assert '"reshard_grow_ms"' in env["ROLLOUT_COSTS_JSON"]
    side = _env(sidecar)
    assert side["ROLLOUT_SIDECAR_TOKEN"] == {
        "secretKeyRef": {"name": "rl-token", "key": k.SECRET_SIDECAR_TOKEN}
    }
    assert side["ROLLOUT_SIDECAR_POD_INDEX"] == "1" and side["ROLLOUT_SIDECAR_PODS"] == "2"
    assert side["ROLLOUT_SIDECAR_ENGINE_URL"] == "http://$(POD_IP):30000"
    assert side["ROLLOUT_SIDECAR_OUTPUT_DIR"] == "/out"
    known = {"ROLLOUT_SIDECAR_" + f.upper() for f in SidecarFields.model_fields}
    assert {n for n in side if n.startswith("ROLLOUT_SIDECAR_")} <= known
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": k.SIDECAR_PORT}


def test_a_cpu_job_asks_for_no_gpu_and_a_queue_less_job_no_kueue_labels() -> None:
    s = parsed()
    got = plan_pods(s, PROFILE)
    assert isinstance(got, tuple)
    pod = build_pod(JobRef("rl", "ns", "u", {}), s, 0, got[0])
    assert "nvidia.com/gpu" not in str(pod["spec"]["containers"][0]["resources"])
    assert k.KUEUE_QUEUE not in pod["metadata"]["labels"] and "annotations" not in pod["metadata"]


def test_the_secret_and_the_headless_service() -> None:
    secret = build_secret(JOB, "key", "tok")
    assert secret["metadata"]["name"] == "rl-token" and secret["metadata"]["ownerReferences"] == [JOB.owner()]
    assert base64.b64decode(secret["data"][k.SECRET_SIDECAR_TOKEN]).decode() == "tok"
    svc = build_service(JOB)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == k.job_labels("rl")
    assert {p["port"] for p in svc["spec"]["ports"]} == {k.ENGINE_PORT, k.SIDECAR_PORT, k.ADMIN_PORT}


CLUSTER_EXAMPLES = sorted((Path(__file__).parents[3] / "examples" / "cluster").glob("*.yaml"))


@pytest.mark.parametrize("path", CLUSTER_EXAMPLES, ids=[p.name for p in CLUSTER_EXAMPLES])
def test_the_cluster_examples_pass_every_check_with_the_shipped_profiles(path: Path, tmp_path: Path) -> None:
    from rollout_operator.api.manifest import load_job
    from rollout_operator.control.profiles import find_profile
    from rollout_profiler.store import migrate
    from rollout_profiler.store.database import make_engine
    from sqlalchemy.orm import Session

    job = load_job(path).job
    profiles = Path(__file__).parents[3] / "profiles"
    url = f"sqlite:///{tmp_path / 'db'}"
    migrate.upgrade(url)
    with Session(make_engine(url)) as session:
        prof = find_profile(job.spec, session, profiles)
    assert isinstance(prof, Profile), prof
    assert check_cluster_fields(job.metadata.name, job.spec) is None
    got = plan_pods(job.spec, prof)
    assert isinstance(got, tuple), got
    plan = got[0]
    pod = build_pod(JobRef(job.metadata.name, "ns", "u", job.metadata.labels), job.spec, 0, plan)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(job.spec.gpus_per_pod)
