"""Names the operator, its pods, the chart and the tests share: the API group's label and annotation keys,
the pods' container names, ports and secret keys. Constants only (no Kubernetes client, no kopf)."""

from __future__ import annotations

from typing import Final

from rollout_operator.api.job import API_VERSION, KIND

GROUP: Final = "elasticrollout.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "rolloutjobs"
FINALIZER: Final = f"{GROUP}/finalizer"
assert f"{GROUP}/{VERSION}" == API_VERSION and KIND == "RolloutJob"

# labels on every object the operator makes for a job (selectors use the first two)
LABEL_JOB: Final = f"{GROUP}/job"
LABEL_POD_INDEX: Final = f"{GROUP}/pod-index"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
APP_NAME: Final = "elastic-rollout"
MANAGER: Final = "elastic-rollout-operator"
COMPONENT_POD: Final = "rollout-pod"  # what the chart's NetworkPolicy selects

# Kueue's plain-pod integration: the job's queue label is copied to its pods, which form one pod group
KUEUE_QUEUE: Final = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP: Final = "kueue.x-k8s.io/pod-group-name"
KUEUE_POD_GROUP_TOTAL: Final = "kueue.x-k8s.io/pod-group-total-count"

# the two containers of a pod and their ports (the headless Service names them too)
ENGINE_CONTAINER: Final = "engine"
SIDECAR_CONTAINER: Final = "sidecar"
ENGINE_PORT: Final = 30000  # SGLang's HTTP API, for RL frameworks that drive the engine themselves
SIDECAR_PORT: Final = 8080  # the sidecar's API: progress, state, samples, health, metrics
ADMIN_PORT: Final = 8081  # the sidecar's admin port: plans (only the operator may reach it)

# the job's Secret ({job}-token): the engine's API key and the sidecar's bearer token
SECRET_ENGINE_KEY: Final = "engine-key"
SECRET_SIDECAR_TOKEN: Final = "sidecar-token"

# the environment every pod container gets (the kubelet fills POD_IP from the downward API)
ENV_POD_IP: Final = "POD_IP"
ENV_LISTEN: Final = "ROLLOUT_LISTEN"  # the address both servers bind: 0.0.0.0, or $(POD_IP)
ENV_JOB: Final = "ROLLOUT_JOB"
ENV_POD_INDEX: Final = "ROLLOUT_POD_INDEX"


def secret_name(job: str) -> str:
    return f"{job}-token"


def pod_name(job: str, index: int) -> str:
    return f"{job}-{index}"


def job_labels(job: str) -> dict[str, str]:
    """The labels that select every object of ``job``."""
    return {LABEL_JOB: job, LABEL_NAME: APP_NAME, LABEL_MANAGED_BY: MANAGER}


def selector(job: str) -> str:
    """A label selector for ``job``'s objects."""
    return f"{LABEL_JOB}={job},{LABEL_MANAGED_BY}={MANAGER}"
