"""Property test over random small workloads, profiles, memory limits and admission policies:
tail bound <= free-switch bound <= count-balanced oracle <= every policy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.profile import CostModel, KVCapacity, ModelShape, Profile, StepPoint
from rollout_profiler.sim.config import SimConfig
from rollout_profiler.sim.simulate import simulate
from rollout_profiler.sim.simulator import Simulator
from rollout_profiler.sim.workloads import Workload

SHAPE = ModelShape("toy", "LlamaForCausalLM", 64, 2, 8, 8, 8, 128, 100)
ms_ = st.floats(0.0, 50.0, allow_nan=False)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Profile, Workload, SimConfig]:
    gpus = draw(st.sampled_from([2, 4]))
    tps = [t for t in (1, 2, 4) if gpus % t == 0]
    n = draw(st.integers(2, 16))
    lengths = np.array(draw(st.lists(st.integers(1, 80), min_size=n, max_size=n)))
    prompts = np.array(draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)))
    caps = lengths + np.array(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)))
    points = []
    for t in tps:
        a, s, u = draw(st.floats(1, 20)), draw(st.floats(0.0, 3.0)), draw(st.floats(0.0, 0.02))
        points += [
            StepPoint(gpus // t, t, b, c, a + s * b + u * b * c)
            for b in (1, 2, 4, 8, 16, 32)
            for c in (0, 64, 256)
        ]
    fixed = [draw(ms_) for _ in range(7)]
    costs = CostModel(draw(st.floats(10.0, 1e6)), fixed[0], draw(st.floats(1.0, 1e3)), *fixed[1:])
    capacity = None
    if draw(st.booleans()):
        need = int((prompts + caps).max())
        tokens = {t: draw(st.integers(need // 2, 6 * need)) for t in tps}
        tokens[max(tps)] = max(tokens[max(tps)], need)  # at least one layout holds every request
        capacity = KVCapacity(tokens)
    prof = Profile("rand", SHAPE, "test", "cuda", gpus, "", "bfloat16", "modelled", points, [], costs,
                   kv_capacity=capacity)  # fmt: skip
    cfg = SimConfig(
        gpus,
        admission=draw(st.sampled_from(["engine", "sglang"])),
        decide_every_ms=draw(st.floats(5.0, 200.0)),
        oracle_per_octave=2,
        oracle_replays=15,
        initial_layout=draw(st.sampled_from(["auto", "smallest"])),
    )
    return prof, Workload("rand", lengths, prompts, caps), cfg


@settings(max_examples=40, deadline=None)
@given(cases())
def test_tail_le_free_switch_le_oracle_le_every_policy(case: tuple[Profile, Workload, SimConfig]) -> None:
    prof, wl, cfg = case
    model = LatencyModel(prof)
    statics = [f"static:{lay.tp}" for lay in Simulator(model, wl, cfg).candidates()]
    res = simulate(model, wl, cfg, [*statics, "adaptive", "oracle", "free-switch", "tail-bound"])
    lat = {k: r.latency_s for k, r in res.items()}
    eps = 1e-9
    assert lat["tail-bound"] <= lat["free-switch"] + eps
    assert lat["free-switch"] <= lat["oracle"] + eps
    for p in [*statics, "adaptive"]:
        assert lat["oracle"] <= lat[p] + eps, p
        assert res[p].admission == cfg.admission
