"""The Kubernetes permissions the operator needs, exactly the verbs it uses: its own calls (children, the
Secret, TTL deletion) and kopf's (watching RolloutJobs, finalizers and status, Events, peering, discovery).
The chart's RBAC must grant exactly these (tests/deploy); the end-to-end tests check that every request the
operator made on the emulator is one of them."""

from __future__ import annotations

from rollout_operator.api import cluster as k

Rule = tuple[str, str, tuple[str, ...]]  # (apiGroup, resource, verbs)

# in every namespace the operator watches
NAMESPACED: tuple[Rule, ...] = (
    (k.GROUP, k.PLURAL, ("delete", "list", "patch", "watch")),  # kopf watches and patches; TTL deletes
    (k.GROUP, f"{k.PLURAL}/status", ("patch",)),
    ("", "pods", ("create", "delete", "list")),
    ("", "services", ("create",)),
    ("", "secrets", ("create", "get")),
    ("", "events", ("create",)),
)
# cluster-wide, whatever it watches (kopf follows namespaces and CustomResourceDefinitions)
CLUSTER: tuple[Rule, ...] = (
    ("", "namespaces", ("list", "watch")),
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
)
# kopf peering, with more than one replica: KopfPeering in its namespace, ClusterKopfPeering cluster-wide
PEERING: tuple[Rule, ...] = (("kopf.dev", "kopfpeerings", ("list", "patch", "watch")),)
CLUSTER_PEERING: tuple[Rule, ...] = (("kopf.dev", "clusterkopfpeerings", ("list", "patch", "watch")),)


def allows(rules: tuple[Rule, ...], group: str, resource: str, verb: str) -> bool:
    return any(g == group and r == resource and verb in verbs for g, r, verbs in rules)
