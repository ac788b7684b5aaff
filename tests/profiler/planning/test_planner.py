"""Planner table tests on a hand-made 8-GPU profile (step = a_T + b_T x batch, context-free).

Pod step with n running, balanced: 8x1 10 + n/80, 4x2 6 + 0.0375 n, 2x4 4 + 0.125 n, 1x8 3 + 0.5 n, so
8x1 is best above n = 160, 4x2 down to ~23, 2x4 down to ~3, then 1x8 (4x2 -> 1x8 directly below ~6.5).
With no finished request and no prior, the predictor says every request runs to its cap: remaining
lengths are exact, which makes gains hand-checkable.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from rollout_profiler.planning import forecast
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import Decision, choose_start, decide, forward_plan, switch_cost
from rollout_profiler.planning.policy import LastSwitch, PlannerPolicy, PodSnapshot, ReplicaState
from rollout_profiler.planning.predictor import LengthPredictor, fit
from rollout_profiler.profile import CostModel, ModelShape, Profile, StepPoint
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

SHAPE = ModelShape("toy", "LlamaForCausalLM", 64, 2, 8, 8, 8, 128, 100)  # 1,024 KV bytes/token (fp32)
LINES = {1: (10.0, 0.1), 2: (6.0, 0.15), 4: (4.0, 0.25), 8: (3.0, 0.5)}
COSTS = CostModel(
    migrate_bytes_per_ms=1e6,
    migrate_fixed_ms=1.0,
    recompute_tokens_per_ms=100.0,
    recompute_fixed_ms=1.0,
    reshard_grow_ms=2.0,
    reshard_shrink_ms=50.0,
    sync_ms=5.0,
)
ALL = tuple(Layout.for_tp(8, t) for t in (1, 2, 4, 8))
L81, L42, L24, L18 = ALL


def profile(costs: CostModel = COSTS) -> Profile:
    pts = [
        StepPoint(8 // t, t, b, c, a + s * b)
        for t, (a, s) in LINES.items()
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
        for c in (100, 100_000)
    ]
    return Profile("hand8", SHAPE, "test", "cuda", 8, "", "float32", "modelled", pts, [], costs)


def snapshot(layout: Layout, caps: list[int], generated: int = 0, ready: tuple[bool, ...] | None = None,
             step: int = 100, time_s: float = 50.0) -> PodSnapshot:  # fmt: skip
    """Requests dealt round-robin over the replicas; prompt 100 tokens each."""
    reps = []
    for r in range(layout.replicas):
        mine = np.asarray(caps[r :: layout.replicas], dtype=float)
        reps.append(ReplicaState(np.full(mine.size, 100.0), np.full(mine.size, float(generated)), mine))
    return PodSnapshot(layout, tuple(reps), ready or (True,) * layout.world, step, time_s)


def to_cap(snap: PodSnapshot) -> LengthPredictor:
    cur = np.concatenate([r.generated for r in snap.replicas])
    caps = np.concatenate([r.cap for r in snap.replicas])
    return fit(np.zeros(0), cur, caps)


def run(snap: PodSnapshot, costs: CostModel = COSTS, **kw: Any) -> Decision:
    policy = PlannerPolicy(
        **{"candidates": ALL, "margin": 0.0, "min_gain_ms": 0.0, "min_gain_fraction": 0.0, **kw}
    )
    return decide(LatencyModel(profile(costs)), snap, policy, to_cap(snap))


def test_must_switch_with_hand_computed_gain() -> None:
    snap = snapshot(L81, [5000] * 16)  # 16 requests, 5,000 steps each
    d = run(snap)
    assert d.action == "switch" and d.target == L24 and d.method == "migrate"
    assert d.predicted_gain_ms == pytest.approx(5000 * (10.2 - 6.0), rel=1e-6)  # 8x1 at b=2 vs 2x4 at b=8
    tokens = 16 * 100
    assert d.predicted_cost_ms == pytest.approx(5.0 + 2.0 + 1.0 + tokens * 1024 * 0.75 / 1e6)


def test_no_switch_when_gain_below_cost() -> None:
    d = run(snapshot(L81, [5000] * 16), costs=replace(COSTS, sync_ms=1e6))
    assert d.action == "keep" and d.target == L81 and d.method is None
    assert "<= cost" in d.reason


def test_margin_and_min_gain_are_respected() -> None:
    snap = snapshot(L81, [5000] * 16)
    costs = replace(COSTS, sync_ms=15_000.0)  # cost comparable to the 21 s gain
    d0 = run(snap, costs)
    assert d0.action == "switch"
    ratio = d0.predicted_gain_ms / d0.predicted_cost_ms - 1
    assert run(snap, costs, margin=ratio * 1.01).action == "keep"
    assert run(snap, costs, margin=ratio * 0.99).action == "switch"
    slack = d0.predicted_gain_ms - d0.predicted_cost_ms
    assert run(snap, costs, min_gain_ms=slack + 1).action == "keep"
    assert run(snap, costs, min_gain_ms=slack - 1).action == "switch"


@pytest.mark.parametrize(
    ("bytes_per_ms", "tokens_per_ms", "method", "want"),
    [
        (1e6, 100.0, "auto", "migrate"),  # fast links: 0.77 ms of copy vs 10 ms of prefill
        (1e3, 100.0, "auto", "recompute"),  # slow links: 768 ms of copy
        (1e3, 1.0, "auto", "migrate"),  # slow links, slower prefill (1,000 ms)
        (1e6, 100.0, "recompute", "recompute"),
        (1e3, 100.0, "migrate", "migrate"),
    ],
)
def test_migrate_vs_recompute(bytes_per_ms: float, tokens_per_ms: float, method: str, want: str) -> None:
    costs = replace(COSTS, migrate_bytes_per_ms=bytes_per_ms, recompute_tokens_per_ms=tokens_per_ms)
    got, ms = switch_cost(costs, 1024, 8, L81, L24, 1000.0, method)
    mig = 5 + 2 + 1 + 1000 * 1024 * 0.75 / bytes_per_ms
    rec = 5 + 2 + 1 + 1000 / tokens_per_ms
    assert got == want and ms == pytest.approx(mig if want == "migrate" else rec)
    d = run(snapshot(L81, [50_000] * 16), costs, method=method)  # long enough for any cost
    assert d.action == "switch" and d.method == want


def test_switch_cost_shrink_and_kv_head_cap() -> None:
    _, grow = switch_cost(COSTS, 1024, 8, L24, L18, 0.0, "migrate")
    _, shrink = switch_cost(COSTS, 1024, 8, L18, L24, 0.0, "migrate")
    assert shrink - grow == pytest.approx(COSTS.reshard_shrink_ms - COSTS.reshard_grow_ms)
    # 2 KV heads, duplicated at TP 4 and 8: 1x8 -> 2x4 keeps on every rank the head it holds (nothing
    # moves), while 2x4 -> 1x8 gives each of the 4 ranks joining a request's replica a copy of one head:
    # twice its KV bytes (as the engine's migration plan sends them)
    assert switch_cost(COSTS, 1024, 2, L18, L24, 1e6, "migrate")[1] == pytest.approx(5 + 50 + 1)
    assert switch_cost(COSTS, 1024, 2, L24, L18, 1e6, "migrate")[1] == pytest.approx(5 + 2 + 1 + 2 * 1024)


def test_cooldown_steps_and_seconds() -> None:
    snap = snapshot(L81, [5000] * 16, step=100, time_s=50.0)
    assert run(snap).action == "switch"
    policy = PlannerPolicy(ALL, margin=0.0, min_gain_ms=0.0, cooldown_steps=20, cooldown_s=5.0)
    model = LatencyModel(profile())
    d = decide(model, snap, policy, to_cap(snap), LastSwitch(step=90, time_s=10.0))
    assert d.action == "keep" and "cooldown" in d.reason and "steps" in d.reason
    d = decide(model, snap, policy, to_cap(snap), LastSwitch(step=50, time_s=48.0))
    assert d.action == "keep" and "cooldown" in d.reason and " s since" in d.reason
    assert decide(model, snap, policy, to_cap(snap), LastSwitch(step=50, time_s=40.0)).action == "switch"


def test_the_default_cooldown_is_ten_times_the_last_switch() -> None:
    snap = snapshot(L81, [5000] * 16, step=100, time_s=50.0)
    policy = PlannerPolicy(ALL, margin=0.0, min_gain_ms=0.0)  # cooldown_s None: from the switch's cost
    model = LatencyModel(profile())
    took_1s = LastSwitch(step=50, time_s=45.0, cost_s=1.0)  # 5 s ago: 10 s of cooldown
    d = decide(model, snap, policy, to_cap(snap), took_1s)
    assert d.action == "keep" and d.reason == "cooldown: 5.0 s since switch"
    assert decide(model, snap, policy, to_cap(snap), replace(took_1s, cost_s=0.4)).action == "switch"
    assert decide(model, snap, replace(policy, cooldown_s=0.0), to_cap(snap), took_1s).action == "switch"


def test_a_switch_must_gain_a_share_of_the_time_left() -> None:
    snap = snapshot(L81, [5000] * 16)  # gain 5000 x (10.2 - 6.0) ms of 5000 x 10.2 ms left: 41%
    assert run(snap, min_gain_fraction=0.4).action == "switch"
    d = run(snap, min_gain_fraction=0.42)
    assert d.action == "keep" and f"+ {0.42 * 5000 * 10.2:.0f}" in d.reason
    with pytest.raises(UserError, match="min_gain_fraction"):
        PlannerPolicy(ALL, min_gain_fraction=-0.1)


def test_not_ready_rank_blocks_action() -> None:
    ready = (True,) * 3 + (False,) + (True,) * 4
    d = run(snapshot(L81, [5000] * 16, ready=ready))
    assert d.action == "keep" and "not ready: [3]" in d.reason


def test_only_candidates_and_no_shrink_by_default() -> None:
    d = run(snapshot(L81, [5000] * 16), candidates=(L81, L42))
    assert d.action == "switch" and d.target == L42
    big = snapshot(L18, [5000] * 1024)  # 1x8 with 1,024 requests: 8x1 is far faster
    assert run(big).action == "keep"
    d = run(big, allow_shrink=True)
    assert d.action == "switch" and d.target.tp < 8


def test_batch_limit_rules_out_layouts() -> None:
    d = run(snapshot(L81, [5000] * 16), max_batch_per_replica=4)  # 2x4 would need 8 per replica
    assert d.action == "switch" and d.target == L42


def test_chain_8x1_4x2_1x8() -> None:
    caps = np.linspace(1000, 40_000, 200).round().astype(int).tolist()  # staggered ends: the batch shrinks
    policy = PlannerPolicy((L81, L42, L18), margin=0.1, min_gain_ms=10.0, chunks=64)
    model = LatencyModel(profile())
    snap = snapshot(L81, caps)
    plan = forward_plan(model, snap, policy, to_cap(snap))
    assert [t.layout for t in plan] == [L42, L18]
    assert (
        plan[0].unfinished_at_most > plan[1].unfinished_at_most and plan[0].steps_ahead < plan[1].steps_ahead
    )
    assert 100 <= plan[0].unfinished_at_most <= 200 and plan[1].unfinished_at_most <= 10
    assert decide(model, snap, policy, to_cap(snap)).action == "keep"  # 200 running: 8x1 is still best
    later = snapshot(L81, caps[-100:], generated=0)
    d1 = decide(model, later, policy, to_cap(later))
    assert d1.action == "switch" and d1.target == L42 and [t.layout for t in d1.plan] == [L42, L18]
    tail = snapshot(L42, caps[-5:], generated=0)
    d2 = decide(model, tail, policy, to_cap(tail), LastSwitch(step=0, time_s=0.0))
    assert d2.action == "switch" and d2.target == L18


def test_nothing_running_keeps() -> None:
    snap = snapshot(L81, [])
    d = decide(LatencyModel(profile()), snap, PlannerPolicy(ALL), fit(np.zeros(0), np.zeros(0), np.zeros(0)))
    assert d.action == "keep" and "no unfinished" in d.reason


def test_gpu_switch_terms_are_paid_by_every_switch() -> None:
    """CUDA-graph capture and the KV pool's re-layout: in the one cost model, 0 unless a profile says."""
    assert (COSTS.graph_capture_ms, COSTS.kv_pool_ms) == (0.0, 0.0)
    costs = replace(COSTS, graph_capture_ms=400.0, kv_pool_ms=25.0)
    assert costs.base_ms(1, 4) == 5.0 + 2.0 + 400.0 + 25.0
    assert costs.base_ms(4, 1) == 5.0 + 50.0 + 400.0 + 25.0
    method, ms = switch_cost(costs, 1024, 8, L81, L24, 1000.0, "auto")
    assert method == "migrate" and ms == pytest.approx(5 + 2 + 400 + 25 + 1 + 1000 * 1024 * 0.75 / 1e6)


def test_kv_capacity_and_admission_price_waiting() -> None:
    """64 requests of 5,000 tokens on 8x1 (b = 8, 10.8 ms); 4x2 would run 16 per replica at 8.4 ms, but
    holds only 40,800 KV tokens per replica: 8 requests reserving prompt + max_new_tokens = 5,100 each."""
    snap = snapshot(L81, [5000] * 64)
    assert run(snap).target == L42  # no memory limit: 4x2
    tokens = ((2, 40_800),)
    kept = run(snap, kv_tokens_per_replica=tokens, admission="engine")  # 2 turns of batch 8: 2 x 7.2 ms
    assert kept.action == "keep"  # > 10.8 ms
    # sglang and paged (the default) admit by tokens in use: 16 fit while contexts are short, so 4x2 pays
    # for most of the run
    assert run(snap, kv_tokens_per_replica=tokens, admission="sglang").target == L42
    assert run(snap, kv_tokens_per_replica=tokens).target == L42


def test_busiest_replica_drifts_after_a_balanced_switch() -> None:
    n = np.array([100.0, 50.0, 0.0])
    assert forecast._busiest(n, 100.0, 1).tolist() == [100.0, 50.0, 0.0]
    got = forecast._busiest(n, 100.0, 2)
    assert got[0] == pytest.approx(50.0) and got[2] == pytest.approx(0.0)  # all or none left: no spread
    assert got[1] == pytest.approx(25 + 0.5642 * np.sqrt(50 * 0.5 * 0.5))  # binomial shares of 2 replicas


def test_choose_start_layout() -> None:
    waiting = PodSnapshot(L81, (ReplicaState(np.zeros(0), np.zeros(0), np.zeros(0), 64),), (True,) * 8,
                          0, 0.0, 100, 5000)  # fmt: skip
    pred = fit(np.zeros(0), np.zeros(64), np.full(64, 5000.0))
    model = LatencyModel(profile())
    assert choose_start(model, waiting, PlannerPolicy(ALL), pred) == L42
    limited = PlannerPolicy(ALL, kv_tokens_per_replica=((2, 40_800),), admission="engine")
    assert choose_start(model, waiting, limited, pred) == L81  # reserving prompt + max_new_tokens
