"""The few Kubernetes API calls the operator makes itself (kopf patches the RolloutJob and posts Events):
make a job's children, list and delete its pods, read its Secret, delete a finished job. Objects go in and
come out as plain dicts (camelCase, as in manifests). Creating is idempotent: AlreadyExists (409) means a
restarted operator, or a retried handler, made it already; deleting something gone (404) is done."""

from __future__ import annotations

import base64
import logging
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from rollout_operator.api import cluster as k

log = logging.getLogger(__name__)
Manifest = dict[str, Any]
USER_AGENT = "elastic-rollout-operator"


async def connect() -> client.ApiClient:
    """In-cluster credentials when in a pod, else $KUBECONFIG (or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    api = client.ApiClient()
    api.user_agent = USER_AGENT
    return api


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    async def close(self) -> None:
        await self.api.close()

    def _plain(self, obj: Any) -> Manifest:
        out: Manifest = self.api.sanitize_for_serialization(obj)
        return out

    async def create(self, obj: Manifest) -> bool:
        """Create ``obj`` (a Pod, Service or Secret); False when it exists already."""
        ns, kind = obj["metadata"]["namespace"], obj["kind"]
        make: Any = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "Secret": self.core.create_namespaced_secret,
        }[kind]
        try:
            await make(ns, obj)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        log.info("created %s %s/%s", kind, ns, obj["metadata"]["name"])
        return True

    async def pods(self, namespace: str, job: str) -> list[Manifest]:
        """The job's pods (filtered by its labels here too: a selector the server ignored costs nothing)."""
        got = await self.core.list_namespaced_pod(namespace, label_selector=k.selector(job))
        want = k.job_labels(job)
        out = []
        for pod in got.items:
            plain = self._plain(pod)
            labels = plain.get("metadata", {}).get("labels") or {}
            if all(labels.get(key) == value for key, value in want.items()):
                out.append(plain)
        return out

    async def delete_pod(self, namespace: str, name: str) -> None:
        try:
            await self.core.delete_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        log.info("deleted pod %s/%s", namespace, name)

    async def secret(self, namespace: str, name: str) -> dict[str, str] | None:
        """The Secret's values, decoded; None when it does not exist."""
        try:
            got = await self.core.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {key: base64.b64decode(v).decode() for key, v in (got.data or {}).items()}

    async def delete_job(self, namespace: str, name: str) -> None:
        try:
            await self.custom.delete_namespaced_custom_object(k.GROUP, k.VERSION, namespace, k.PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
