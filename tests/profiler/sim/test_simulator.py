"""Simulator: exact hand-computed cases, the oracle as a lower bound, timeline sanity."""

from __future__ import annotations

import numpy as np
import pytest
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.profile import CostModel, ModelShape, Profile, StepPoint
from rollout_profiler.profiling import modelled
from rollout_profiler.sim.oracle import oracle
from rollout_profiler.sim.run import parse_policies, simulate
from rollout_profiler.sim.simulator import (
    AdaptiveController,
    ScheduleController,
    SimConfig,
    SimResult,
    Simulator,
)
from rollout_profiler.sim.workloads import Workload, synthetic
from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout

SHAPE = ModelShape("toy", "LlamaForCausalLM", 64, 2, 8, 8, 8, 128, 100)
COSTS = CostModel(1e30, 0.0, 100.0, 50.0, 1.0, 30.0, 5.0)  # a grow switch costs 5 + 1 + 0 ms


def tiny_profile() -> Profile:
    """2 GPUs: replica step 10 + batch ms at TP1, 6 + batch ms at TP2, whatever the context."""
    pts = [
        StepPoint(2 // t, t, b, c, base + b)
        for t, base in ((1, 10.0), (2, 6.0))
        for b in (1, 2, 4)
        for c in (0, 1000)
    ]
    return Profile("tiny2", SHAPE, "test", "cpu", 2, "", "float32", "modelled", pts, [], COSTS)


def tiny_workload() -> Workload:
    return Workload("tiny", np.array([1, 2, 3, 5]), np.full(4, 10), np.full(4, 5))


def test_static_matches_hand_computation() -> None:
    sim = Simulator(LatencyModel(tiny_profile()), tiny_workload(), SimConfig(gpus=2))
    # 2x1, round-robin: replica 0 holds lengths 1 and 3, replica 1 lengths 2 and 5
    # steps: (2,2) 12, (1,2) 12, (1,1) 11, (0,1) 11, (0,1) 11 = 57 ms
    r1 = sim.run(Layout(2, 1), name="static:1")
    assert r1.latency_s == pytest.approx(0.057)
    assert r1.gpu_busy == pytest.approx((12 * 2 + 12 * 2 + 11 * 2 + 11 + 11) / (2 * 57))
    # 1x2: batch 4, 3, 2, 1, 1 -> 10 + 9 + 8 + 7 + 7 = 41 ms
    r2 = sim.run(Layout(1, 2), name="static:2")
    assert r2.latency_s == pytest.approx(0.041) and r2.gpu_busy == pytest.approx(1.0)
    assert r2.reconfigs == []


def test_switch_charges_cost_and_rebalances() -> None:
    sim = Simulator(LatencyModel(tiny_profile()), tiny_workload(), SimConfig(gpus=2))
    r = sim.run(Layout(2, 1), name="s", controller=ScheduleController([(2, Layout(1, 2))]))
    # 2 steps at 2x1 (12 + 12), switch 5 + 1 + 0 (migrate, infinite bandwidth), then 1x2 with lengths
    # 3 and 5 left: batch 2, 1, 1 -> 8 + 7 + 7
    assert r.latency_s == pytest.approx((24 + 6 + 22) / 1e3)
    assert [(c.step, c.src, c.dst, c.method, c.running) for c in r.reconfigs] == [
        (2, "2x1", "1x2", "migrate", 2)
    ]
    assert r.reconfigs[0].cost_ms == pytest.approx(6.0)
    assert [x[2] for x in r.timeline][-1] == 2


def test_batch_limit_queues_requests() -> None:
    sim = Simulator(LatencyModel(tiny_profile()), tiny_workload(), SimConfig(gpus=2, max_batch_per_replica=1))
    r = sim.run(Layout(1, 2), name="static:2")
    assert r.latency_s == pytest.approx(11 * 7 / 1e3)  # one request at a time: 1+2+3+5 steps of 7 ms


def check_timeline(r: SimResult, tps: set[int]) -> None:
    times = [x[0] for x in r.timeline]
    running = [x[1] for x in r.timeline]
    assert times == sorted(times) and times[-1] <= r.latency_s + 1e-9
    assert running == sorted(running, reverse=True) and running[-1] == 0
    assert {x[2] for x in r.timeline} <= tps
    changes = sum(1 for a, b in zip(r.timeline, r.timeline[1:], strict=False) if a[2] != b[2])
    assert changes == sum(1 for c in r.reconfigs if Layout.parse(c.src).tp != Layout.parse(c.dst).tp)
    assert 0 < r.gpu_busy <= 1.0 + 1e-9


@pytest.fixture(scope="module")
def llama() -> LatencyModel:
    return LatencyModel(modelled.build(modelled.LLAMA_31_8B, "llama"))


WORKLOADS = [
    ("deepscaler-8k", 12, 0),
    ("deepscaler-8k", 12, 1),
    ("deepscaler-16k", 6, 0),
    ("deepscaler-16k", 6, 1),
]


@pytest.mark.parametrize(("name", "prompts", "seed"), WORKLOADS)
def test_oracle_never_slower_and_timelines(llama: LatencyModel, name: str, prompts: int, seed: int) -> None:
    wl = synthetic(name, seed, prompts=prompts)
    prev = synthetic(name, seed + 1000, prompts=prompts)
    cfg = SimConfig(gpus=8, prior=Prior.from_samples(prev.lengths, prev.caps), decide_every=64)
    policies = ["static:1", "static:2", "static:4", "static:8", "adaptive", "oracle"]
    res = simulate(llama, wl, cfg, policies)
    assert list(res) == policies
    for p, r in res.items():
        assert r.latency_s >= res["oracle"].latency_s - 1e-9, p
        check_timeline(r, {1, 2, 4, 8})
    assert all(not r.reconfigs for p, r in res.items() if p.startswith("static"))


def test_oracle_dp_is_exact_without_batch_limit(llama: LatencyModel) -> None:
    wl = synthetic("deepscaler-8k", 3, prompts=12)
    res = simulate(llama, wl, SimConfig(gpus=8), ["static:1", "static:8", "oracle"])
    detail = res["oracle"].detail
    assert detail.startswith("dp chain")  # the chain search won (it knows every length) ...
    dp = float(detail.split("(dp ")[1].split(" s")[0])
    assert res["oracle"].latency_s == pytest.approx(dp, abs=0.01)  # ... and its replay matches the DP
    assert res["oracle"].latency_s <= min(res["static:1"].latency_s, res["static:8"].latency_s)


def test_count_balanced_oracle(llama: LatencyModel) -> None:
    wl = synthetic("deepscaler-16k", 2, prompts=6)
    sim = Simulator(llama, wl, SimConfig(gpus=8))
    statics = [sim.run(Layout.for_tp(8, t), name=f"static:{t}") for t in (1, 2, 4, 8)]
    blind = oracle(sim, statics, balance="count")
    full = oracle(sim, statics)
    assert full.latency_s <= blind.latency_s <= min(r.latency_s for r in statics)
    if blind.detail.startswith("dp chain"):
        assert blind.latency_s == pytest.approx(float(blind.detail.split("(dp ")[1].split(" s")[0]), abs=0.01)


def test_adaptive_does_not_peek_at_lengths(llama: LatencyModel) -> None:
    """Two workloads that agree on every request up to step 3,000: same decisions until then."""
    base = synthetic("deepscaler-8k", 4, prompts=16)
    longer = np.where(base.lengths > 3000, np.minimum(base.lengths + 2000, base.caps), base.lengths)
    other = Workload("other", longer, base.prompt_lens, base.caps)
    runs = []
    for wl in (base, other):
        sim = Simulator(llama, wl, SimConfig(gpus=8))
        ctl = AdaptiveController(sim, sim.policy(), None, 32)
        sim.run(Layout(8, 1), name="adaptive", controller=ctl)
        runs.append([(s, d) for s, d in zip(ctl.steps, ctl.decisions, strict=True) if s <= 3000])
    assert len(runs[0]) == 3000 // 32 + 1 and runs[0] == runs[1]


def test_oracle_on_tiny_case_beats_statics() -> None:
    model = LatencyModel(tiny_profile())
    res = simulate(model, tiny_workload(), SimConfig(gpus=2), ["static:1", "static:2", "adaptive", "oracle"])
    assert res["oracle"].latency_s <= 0.041 + 1e-12
    assert res["oracle"].latency_s <= res["adaptive"].latency_s


def test_bad_policies() -> None:
    assert parse_policies("static:1, adaptive,oracle", 8) == ["static:1", "adaptive", "oracle"]
    with pytest.raises(UserError, match="item 2"):
        parse_policies("static:1,fast", 8)
    with pytest.raises(UserError, match="TP 3 does not divide 8"):
        parse_policies("static:3", 8)
    with pytest.raises(UserError, match="no policy"):
        parse_policies(" , ", 8)
