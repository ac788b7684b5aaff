"""The Kubernetes objects of a RolloutJob, as pure functions of the job (no client, no kopf): its token
Secret, its headless Service and one Pod per index, each owned by the job (garbage-collected with it).

Each pod runs the engine server (``rolloutctl serve``) and the sidecar (``rolloutctl sidecar``) from the
job's image. Secrets reach the containers as environment variables from the Secret; the pod's own address
from the downward API (``$(POD_IP)``), where both servers bind (``all``: 0.0.0.0) and where the sidecar finds
the engine."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

from rollout_worker.scheduling.costs import CostModel
from rollout_worker.scheduling.layout import Layout
from rollout_worker.sidecar.settings import env_name, settings_env

from rollout_operator.api import cluster as k
from rollout_operator.api.job import API_VERSION, KIND, RolloutJobSpec
from rollout_operator.control.podspec import engine_args, engine_env, sidecar_fields

Manifest = dict[str, Any]


@dataclass(frozen=True)
class JobRef:
    """The job object the children belong to."""

    name: str
    namespace: str
    uid: str
    labels: dict[str, str]

    def owner(self) -> Manifest:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def metadata(self, name: str, extra_labels: dict[str, str] | None = None) -> Manifest:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": k.job_labels(self.name) | (extra_labels or {}),
            "ownerReferences": [self.owner()],
        }


@dataclass(frozen=True)
class PodPlan:
    """What the operator decided for the job's pods: the starting layout, the layouts the engine may switch
    to, the switch-cost model the engines price with (the profile's), and where the servers bind."""

    layout: Layout
    candidates: tuple[Layout, ...]
    costs: CostModel | None = None  # the profile's, for the engine (None: its built-in priors)
    listen: Literal["all", "pod-ip"] = "all"


def build_secret(job: JobRef, engine_key: str, token: str) -> Manifest:
    def b64(s: str) -> str:
        return base64.b64encode(s.encode()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": job.metadata(k.secret_name(job.name)),
        "type": "Opaque",
        "data": {k.SECRET_ENGINE_KEY: b64(engine_key), k.SECRET_SIDECAR_TOKEN: b64(token)},
    }


def _ports() -> list[Manifest]:
    return [
        {"name": "engine", "port": k.ENGINE_PORT, "targetPort": k.ENGINE_PORT, "protocol": "TCP"},
        {"name": "sidecar", "port": k.SIDECAR_PORT, "targetPort": k.SIDECAR_PORT, "protocol": "TCP"},
        {"name": "admin", "port": k.ADMIN_PORT, "targetPort": k.ADMIN_PORT, "protocol": "TCP"},
    ]


def build_service(job: JobRef) -> Manifest:
    """Headless: each pod is reachable as ``{job}-{i}.{job}.{namespace}.svc`` (ready or not, so a planner
    can watch a pod that is still loading)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": job.metadata(job.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": k.job_labels(job.name),
            "ports": _ports(),
        },
    }


def _secret_env(job: str, var: str, key: str) -> Manifest:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": k.secret_name(job), "key": key}}}


def _common_env(job: JobRef, index: int, listen: str) -> list[Manifest]:
    return [
        {"name": k.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": k.ENV_LISTEN, "value": "0.0.0.0" if listen == "all" else f"$({k.ENV_POD_IP})"},
        {"name": k.ENV_JOB, "value": job.name},
        {"name": k.ENV_POD_INDEX, "value": str(index)},
    ]


def _http_probe(path: str, port: int, period: int, failures: int) -> Manifest:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


def engine_container(job: JobRef, spec: RolloutJobSpec, index: int, plan: PodPlan) -> Manifest:
    args = [
        "serve", *engine_args(spec, plan.layout, list(plan.candidates)),
        "--host", f"$({k.ENV_LISTEN})", "--port", str(k.ENGINE_PORT),
    ]  # fmt: skip
    env = _common_env(job, index, plan.listen)
    env.append(_secret_env(job.name, "ROLLOUT_API_KEY", k.SECRET_ENGINE_KEY))
    env += [{"name": n, "value": v} for n, v in engine_env(plan.costs).items()]
    pod = spec.pod
    resources: Manifest = {kind: dict(v) for kind, v in pod.resources.items() if isinstance(v, dict)}
    gpus = str(spec.gpus_per_pod)
    if spec.engine.device == "cuda":  # a CPU engine (tests, CPU clusters) asks for no accelerator
        resources.setdefault("limits", {})[pod.gpu_resource_name] = gpus
        resources.setdefault("requests", {})[pod.gpu_resource_name] = gpus
    return {
        "name": k.ENGINE_CONTAINER,
        "image": pod.image,
        "imagePullPolicy": pod.image_pull_policy,
        "command": ["rolloutctl"],
        "args": args,
        "env": env,
        "ports": [{"name": "engine", "containerPort": k.ENGINE_PORT, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": list(pod.volume_mounts),
        # a model takes minutes to load: liveness starts once the server answers at all
        "startupProbe": _http_probe("/health", k.ENGINE_PORT, 10, 180),
        "livenessProbe": _http_probe("/health", k.ENGINE_PORT, 10, 6),
    }


def sidecar_container(job: JobRef, spec: RolloutJobSpec, index: int, plan: PodPlan) -> Manifest:
    fields = sidecar_fields(spec, index)
    env_fields = settings_env(
        **fields,
        engine_url=f"http://$({k.ENV_POD_IP}):{k.ENGINE_PORT}",
        token="placeholder",  # validated here; the value comes from the Secret below
        host=f"$({k.ENV_LISTEN})",
        port=k.SIDECAR_PORT,
        admin_port=k.ADMIN_PORT,
    )
    env_fields.pop(env_name("token"))
    env = _common_env(job, index, plan.listen)
    env += [
        _secret_env(job.name, env_name("token"), k.SECRET_SIDECAR_TOKEN),
        _secret_env(job.name, env_name("engine_key"), k.SECRET_ENGINE_KEY),
    ]
    env += [{"name": name, "value": value} for name, value in sorted(env_fields.items())]
    return {
        "name": k.SIDECAR_CONTAINER,
        "image": spec.pod.image,
        "imagePullPolicy": spec.pod.image_pull_policy,
        "command": ["rolloutctl"],
        "args": ["sidecar"],
        "env": env,
        "ports": [
            {"name": "sidecar", "containerPort": k.SIDECAR_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": k.ADMIN_PORT, "protocol": "TCP"},
        ],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": list(spec.pod.volume_mounts),
        "readinessProbe": _http_probe("/readyz", k.SIDECAR_PORT, 5, 3),
        "livenessProbe": _http_probe("/healthz", k.SIDECAR_PORT, 10, 6),
    }


def build_pod(job: JobRef, spec: RolloutJobSpec, index: int, plan: PodPlan) -> Manifest:
    """Pod ``index`` of the job. restartPolicy Never: a failed pod is the operator's to count against
    ``backoffLimit`` and to recreate (it resumes from its output file)."""
    pod = spec.pod
    labels = {k.LABEL_POD_INDEX: str(index), k.LABEL_COMPONENT: k.COMPONENT_POD}
    annotations: dict[str, str] = {}
    queue = job.labels.get(k.KUEUE_QUEUE)
    if queue:  # Kueue admits the job's pods as one group
        labels |= {k.KUEUE_QUEUE: queue, k.KUEUE_POD_GROUP: job.name}
        annotations[k.KUEUE_POD_GROUP_TOTAL] = str(spec.pods)
    meta = job.metadata(k.pod_name(job.name, index), labels)
    if annotations:
        meta["annotations"] = annotations
    body: Manifest = {
        "restartPolicy": "Never",
        "hostname": k.pod_name(job.name, index),
        "subdomain": job.name,
        "terminationGracePeriodSeconds": 30,
        "containers": [
            engine_container(job, spec, index, plan),
            sidecar_container(job, spec, index, plan),
        ],
        "volumes": list(pod.volumes),
        "nodeSelector": dict(pod.node_selector),
        "tolerations": list(pod.tolerations),
    }
    optional = {
        "affinity": pod.affinity,
        "priorityClassName": pod.priority_class_name,
        "serviceAccountName": pod.service_account_name,
    }
    body |= {key: value for key, value in optional.items() if value is not None}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": body}
