"""What the HTTP routes and the metrics read from the engine, taken in one go under the driver's lock and
immutable afterwards: health, layout, pause, weight version, requests per replica and KV use."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_worker.engine.driver.lifecycle import Status
from rollout_worker.engine.driver.request_table import RequestTable
from rollout_worker.scheduling.layout import Layout


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    running: int = 0
    waiting: int = 0  # on the replica, not running (not admitted yet, or retracted)
    kv_used: int = 0  # KV tokens its running requests hold (its last report)
    kv_allocated: int = 0  # KV token slots allocated


@dataclass(frozen=True, slots=True)
class Snapshot:
    status: Status
    layout: Layout
    paused: str | None  # the pause mode while paused
    weight_version: str
    unfinished: int  # every request accepted and not finished
    queued: int  # accepted, not yet given to a replica
    replicas: tuple[ReplicaLoad, ...]  # per replica of ``layout``
    prefill_tokens: int = 0  # tokens prefills computed, since start
    reused_tokens: int = 0  # tokens prefills took from the prefix cache, since start
    spec_verifies: int = 0  # speculative decoding: requests' verify steps, since start
    spec_tokens: int = 0  # the tokens they emitted

    @property
    def spec_accept_length(self) -> float | None:
        """Tokens a request's verify step emits on average (SGLang's ``avg_spec_accept_length``); None
        before any verify step."""
        return self.spec_tokens / self.spec_verifies if self.spec_verifies else None

    @property
    def kv_used(self) -> int:
        """KV tokens held by running requests, over every replica."""
        return sum(r.kv_used for r in self.replicas)

    @property
    def kv_allocated(self) -> int:
        """KV token slots allocated, over every replica."""
        return sum(r.kv_allocated for r in self.replicas)

    @property
    def cache_hit_rate(self) -> float:
        """The share of prefilled tokens taken from the prefix cache (SGLang's ``cache_hit_rate``)."""
        total = self.prefill_tokens + self.reused_tokens
        return self.reused_tokens / total if total else 0.0

    @property
    def running(self) -> int:
        return sum(r.running for r in self.replicas)

    @property
    def waiting(self) -> int:
        """Waiting on a replica or in the driver's queue."""
        return sum(r.waiting for r in self.replicas) + self.queued


def take(table: RequestTable, status: Status, paused: str | None, weight_version: str) -> Snapshot:
    running, waiting = [0] * table.layout.replicas, [0] * table.layout.replicas
    for t in table.reqs.values():
        if t.replica is not None:
            (running if t.status == "running" else waiting)[t.replica] += 1
    return Snapshot(
        status=status,
        layout=table.layout,
        paused=paused,
        weight_version=weight_version,
        unfinished=table.unfinished,
        queued=len(table.queued),
        replicas=tuple(
            ReplicaLoad(r, w, *table.kv.get(d, (0, 0)))
            for d, (r, w) in enumerate(zip(running, waiting, strict=True))
        ),
        prefill_tokens=table.prefill_tokens,
        reused_tokens=table.reused_tokens,
        spec_verifies=table.spec_verifies,
        spec_tokens=table.spec_tokens,
    )
