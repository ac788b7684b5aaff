"""Prometheus metrics with SGLang's names (``sglang:num_running_reqs``, ...) plus the engine's own
(layout, reconfigurations, reconfiguration seconds by phase). Gauges are read from the engine at scrape
time; counters and histograms are fed by the engine's observer hooks on its reader thread."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.engine.driver.engine import Engine, Observer
from rollout_worker.engine.driver.request_table import Outcome, Update
from rollout_worker.engine.finish import FinishAbort
from rollout_worker.engine.messages import StepReport

_LAT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _Gauges(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        eng = self.m.engine
        if eng is None:
            return
        labels, values = ["model_name"], [self.m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        snap = eng.snapshot()
        used, cap = snap.kv_used, snap.kv_allocated
        yield gauge("sglang:num_running_reqs", "Running requests", snap.running)
        yield gauge("sglang:num_queue_reqs", "Waiting requests", snap.waiting)
        yield gauge("sglang:num_used_tokens", "KV tokens held by running requests", used)
        yield gauge(
            "sglang:token_usage", "Fraction of the KV pool's tokens in use", used / cap if cap else 0.0
        )
        yield gauge(
            "sglang:max_total_num_tokens", "Tokens of one replica's KV pool", eng.cfg.engine.pool_tokens
        )
        yield gauge("sglang:gen_throughput", "Generated tokens per second (last 10 s)", self.m.throughput())
        yield gauge(
            "sglang:cache_hit_rate",
            "Share of prefilled tokens found in the prefix cache",
            snap.cache_hit_rate,
        )
        yield counter(
            "sglang:cached_tokens", "Prefilled tokens found in the prefix cache", snap.reused_tokens
        )
        yield counter("elastic_rollout_prefill_tokens", "Tokens computed by prefills", snap.prefill_tokens)
        yield counter(
            "elastic_rollout_spec_verifies",
            "Speculative decoding: requests' verify steps",
            snap.spec_verifies,
        )
        yield counter(
            "elastic_rollout_spec_tokens",
            "Speculative decoding: tokens verify steps emitted",
            snap.spec_tokens,
        )
        lay = snap.layout
        yield gauge("elastic_rollout_tp_size", "Current TP size", lay.tp)
        yield gauge("elastic_rollout_replicas", "Current number of replicas", lay.replicas)
        info = GaugeMetricFamily(
            "elastic_rollout_layout", "Current layout (1 for the active one)", labels=["layout"]
        )
        info.add_metric([str(lay)], 1)
        yield info
        yield gauge(
            "elastic_rollout_healthy", "1 when every rank is serving", 1.0 if snap.status.serving else 0.0
        )


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: Engine | None = None
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens", lab, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generated tokens", lab, registry=r)
        self.requests = Counter("sglang:num_requests", "Finished requests", lab, registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Aborted requests", lab, registry=r)
        self.retracted = Counter(
            "sglang:num_retracted_requests",
            "Requests retracted for want of KV pages (back to the queue, re-prefilled later)",
            lab,
            registry=r,
        )
        self.retracted.labels(model_name)  # exposed (0) before the first retraction
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "TTFT", lab, buckets=_LAT, registry=r)
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds", "Inter-token latency", lab, buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end latency", lab, buckets=_LAT, registry=r
        )
        self.reconfigs = Counter(
            "elastic_rollout_reconfigurations",
            "Layout switches",
            ["src", "dst", "method", "outcome"],
            registry=r,
        )
        self.reconfig_phase = Counter(
            "elastic_rollout_reconfiguration_phase_seconds",
            "Seconds spent per switch phase",
            ["phase"],
            registry=r,
        )
        self.reconfig_seconds = Histogram(
            "elastic_rollout_reconfiguration_seconds", "Whole switch", buckets=_LAT, registry=r
        )
        self.registry.register(_Gauges(self))
        self._recent: deque[tuple[float, int]] = deque(maxlen=4096)

    def observer(self) -> Observer:
        return Observer(
            on_report=self._on_report,
            on_tokens=self._on_tokens,
            on_finish=self._on_finish,
            on_switch=self._on_switch,
        )

    def _on_report(self, r: StepReport) -> None:
        if r.retractions:
            self.retracted.labels(self.model_name).inc(r.retractions)

    def _on_tokens(self, out: Outcome) -> None:
        n = sum(len(u.tokens) for u in out.updates)
        if n:
            self.generation_tokens.labels(self.model_name).inc(n)
            self._recent.append((time.monotonic(), n))
        for s in out.ttft_s:
            self.ttft.labels(self.model_name).observe(s)
        itl = self.itl.labels(self.model_name)
        for s in out.itl_s:
            itl.observe(s)

    def _on_finish(self, u: Update) -> None:
        self.requests.labels(self.model_name).inc()
        if isinstance(u.finish, FinishAbort):
            self.aborted.labels(self.model_name).inc()
        if u.latency is not None:
            self.e2e.labels(self.model_name).observe(u.latency[1])

    def _on_switch(self, ev: ReconfigEvent) -> None:
        self.reconfigs.labels(str(ev.src), str(ev.dst), ev.method, ev.outcome).inc()
        for phase, ms in ev.phases.items():
            if phase != "total_ms":
                self.reconfig_phase.labels(phase.removesuffix("_ms")).inc(ms / 1e3)
        if ev.actual_ms is not None:
            self.reconfig_seconds.observe(ev.actual_ms / 1e3)

    def submitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def throughput(self, window_s: float = 10.0) -> float:
        now = time.monotonic()
        return sum(n for t, n in list(self._recent) if now - t <= window_s) / window_s

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def state(self) -> dict[str, Any]:
        return {"gen_throughput": self.throughput()}
