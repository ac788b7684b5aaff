"""The Kubernetes permissions the chart grants the operator: exactly the operator's own rules
(``rollout_operator.cluster.rbac``, which the end-to-end tests check every request of the operator against).
tests/deploy/test_chart.py checks the rendered chart grants these, no more and no fewer."""

from __future__ import annotations

from rollout_operator.cluster.rbac import CLUSTER, CLUSTER_PEERING, NAMESPACED, PEERING, Rule

__all__ = ["CLUSTER", "CLUSTER_PEERING", "NAMESPACED", "PEERING", "Rule"]
