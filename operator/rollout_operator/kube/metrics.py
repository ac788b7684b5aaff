"""The operator's Prometheus metrics (``/metrics`` on ROLLOUT_OPERATOR_METRICS_PORT)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

P = "rollout_operator_"


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.created = Counter(P + "jobs_created_total", "RolloutJobs accepted", registry=r)
        self.refused = Counter(P + "jobs_refused_total", "RolloutJobs refused (invalid spec)", registry=r)
        self.finished = Counter(P + "jobs_finished_total", "RolloutJobs ended", ["outcome"], registry=r)
        self.pods_created = Counter(P + "pods_created_total", "Pods made (first and again)", registry=r)
        self.events = Counter(P + "events_total", "Events posted, by reason", ["reason"], registry=r)
        self.ticks = Histogram(
            P + "tick_seconds",
            "One job's reconciliation (pods, sidecars, planner)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.tick_errors = Counter(P + "tick_errors_total", "Ticks that failed (retried)", registry=r)

    def event(self, reason: str) -> None:
        self.events.labels(reason).inc()

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, registry=self.registry)
