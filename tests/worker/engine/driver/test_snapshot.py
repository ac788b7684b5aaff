"""What routes read: requests per replica, the driver's queue and KV use, taken from the table at once."""

from __future__ import annotations

from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.driver import snapshot
from rollout_worker.engine.driver.lifecycle import Health, Status
from rollout_worker.engine.driver.request_table import RequestTable
from rollout_worker.engine.messages import StepReport
from rollout_worker.scheduling.layout import Layout


def test_counts_per_replica_queue_and_kv() -> None:
    table = RequestTable(Layout(2, 1))
    for i in range(5):
        table.add(RequestSpec(f"r{i}", (1, 2, i), 8, Sampling()), (), 0.0)  # (one prompt each: by load)
    table.dispatch()  # r0, r2, r4 on replica 0; r1, r3 on replica 1
    table.add(RequestSpec("late", (1,), 8, Sampling()), (), 0.0)  # queued in the driver
    table.on_step(
        StepReport(0, 0, 0, "prefill", 1.0, admitted=("r0", "r2"), kv_tokens=4, kv_capacity=16), 1.0
    )
    table.on_step(StepReport(1, 0, 0, "prefill", 1.0, admitted=("r1",), kv_tokens=2, kv_capacity=16), 1.0)
    snap = snapshot.take(table, Status(Health.READY), "retract", "v2")
    assert [(r.running, r.waiting) for r in snap.replicas] == [(2, 1), (1, 1)]
    assert (snap.running, snap.waiting, snap.queued, snap.unfinished) == (3, 3, 1, 6)
    assert (snap.kv_used, snap.kv_allocated) == (6, 32)
    assert [(r.kv_used, r.kv_allocated) for r in snap.replicas] == [(4, 16), (2, 16)]  # (issue 35)
    assert snap.layout == Layout(2, 1) and snap.paused == "retract" and snap.weight_version == "v2"
    assert snap.status.serving
