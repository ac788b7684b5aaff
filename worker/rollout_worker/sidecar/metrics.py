"""The sidecar's Prometheus metrics (``GET /metrics`` on the API port). Counters are fed as samples are
written and sent again; gauges are read from the sidecar at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

P = "elastic_rollout_sidecar_"


class _Gauges(Collector):
    def __init__(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, (doc, value) in self.read().items():
            yield GaugeMetricFamily(P + name, doc, value=value)


class SidecarMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.written = Counter(
            P + "samples_written", "Samples written to the output file by this process", registry=r
        )
        self.completion_tokens = Counter(
            P + "completion_tokens", "Output tokens of the samples written", registry=r
        )
        self.retries = Counter(
            P + "resends",
            "Samples sent again (reason: aborted, unreachable, unavailable, in_flight)",
            ["reason"],
            registry=r,
        )

    def gauges(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        """Register the scrape-time gauges: name -> (help, value)."""
        self.registry.register(_Gauges(read))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
