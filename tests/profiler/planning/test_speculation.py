"""Speculative decoding in the planner and the simulator (:mod:`rollout_profiler.planning.speculation`): the
time per emitted token is the best of plain decoding and verifying each width, priced on the profile's own
step latency; it changes nothing when no draft is accepted, helps most where a step is memory-bound (small
batches on a GPU), and the simulator's layouts and the planner both run on it."""

from __future__ import annotations

import numpy as np
import pytest
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.speculation import Speculation, SpeculativeLatency
from rollout_profiler.profiling.modelled import SHIPPED, build
from rollout_profiler.sim.config import SimConfig
from rollout_profiler.sim.simulate import simulate
from rollout_profiler.sim.workloads import load
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

LLAMA = next(build(shape, n) for shape, n in SHIPPED.values() if "llama" in n)
LAYOUTS = [Layout(8, 1), Layout(4, 2), Layout(2, 4), Layout(1, 8)]
BATCH = np.array([1.0, 2.0, 8.0, 32.0, 128.0, 512.0])
CTX = np.array([512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0])


def test_nothing_accepted_is_plain_decoding() -> None:
    plain, spec = LatencyModel(LLAMA), SpeculativeLatency(LLAMA, Speculation(0.0))
    for lay in LAYOUTS:
        assert spec.step_ms_many(lay, BATCH, CTX) == pytest.approx(plain.step_ms_many(lay, BATCH, CTX))
        assert spec.step_ms(lay, 3.0, 700.0) == pytest.approx(plain.step_ms(lay, 3.0, 700.0))
    grid = np.tile(BATCH, (4, 1)), np.tile(CTX, (4, 1))
    assert spec.step_ms_layouts(LAYOUTS, *grid) == pytest.approx(plain.step_ms_layouts(LAYOUTS, *grid))


def test_the_time_per_token_is_the_best_width() -> None:
    plain, sp = LatencyModel(LLAMA), Speculation(0.7, 4)
    spec = SpeculativeLatency(LLAMA, sp)
    for lay in LAYOUTS:
        for b, c in zip(BATCH, CTX, strict=True):
            widths = [plain.step_ms(lay, b * (1 + w), c) / sp.tokens(w) for w in range(5)]
            assert spec.step_ms(lay, b, c) == pytest.approx(min(widths))
    grid = np.tile(BATCH, (4, 1)), np.tile(CTX, (4, 1))
    many = np.stack([spec.step_ms_many(lay, BATCH, CTX) for lay in LAYOUTS])
    assert spec.step_ms_layouts(LAYOUTS, *grid) == pytest.approx(many)


def test_speculation_pays_most_where_a_step_is_memory_bound() -> None:
    """A GPU decode step of a few requests barely grows with its rows: verifying 4 drafts costs little more
    than a decode step, so a request's tokens come about 1.6x faster at acceptance 0.4; a large batch gains
    less."""
    plain, spec = LatencyModel(LLAMA), SpeculativeLatency(LLAMA, Speculation(0.4))
    lay = Layout(8, 1)
    speedup = plain.step_ms_many(lay, BATCH, np.full(BATCH.shape, 2048.0)) / spec.step_ms_many(
        lay, BATCH, np.full(BATCH.shape, 2048.0)
    )
    assert np.all(speedup >= 1.0 - 1e-12)
    assert speedup[0] > 1.4 and speedup[-1] < speedup[0]
    assert np.all(np.diff(speedup) <= 1e-9)  # less and less as the batch grows


def test_the_simulator_and_the_planner_run_speculating() -> None:
    """The sparse tail on 8 simulated GPUs: every static layout is faster speculating, and so is adaptive,
    whose planner predicts with the same model (fewer switches pay when the tail runs faster)."""
    wl = load("sparse-tail", 0)
    cfg = SimConfig(8)
    policies = ["static:1", "static:8", "adaptive"]
    plain = simulate(LatencyModel(LLAMA), wl, cfg, policies)
    spec = simulate(SpeculativeLatency(LLAMA, Speculation(0.5)), wl, cfg, policies)
    for p in policies:
        assert spec[p].latency_s < plain[p].latency_s, p
    assert spec["adaptive"].latency_s <= min(spec[p].latency_s for p in ("static:1", "static:8"))


def test_bad_speculation_settings_are_refused() -> None:
    with pytest.raises(UserError, match="spec_accept"):
        Speculation(1.0)
    with pytest.raises(UserError, match="draft_tokens"):
        Speculation(0.5, 0)
