"""The modelled H100 profiles: the published figures they are calibrated to, the KV capacity they store,
the points beyond it flagged, and the shipped files up to date."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_profiler.profile import Profile
from rollout_profiler.profiling import modelled

ROOT = Path(__file__).resolve().parents[3]


def test_calibrated_to_published_batch1_steps_and_growth() -> None:
    hw, cal = modelled.Hardware(), modelled.calibrate()
    for tp, ms in modelled.BATCH1_POINTS:  # vLLM H100, Llama-3-8B: 7.05 / 4.90 / 3.54 / 2.92 ms
        got = modelled.step_ms(modelled.LLAMA_31_8B, hw, cal, tp, 1, modelled.REF_CONTEXT)
        assert got == pytest.approx(ms, rel=0.05), tp
    assert max(abs(r) for r in cal.residual_ms) < 0.15
    (_, b1, y1), (_, b2, y2) = modelled.BATCH_GROWTH  # SGLang TP1: 7.4 ms at batch 1 -> 11.8 at 128
    grow = [modelled.step_ms(modelled.LLAMA_31_8B, hw, cal, 1, b, modelled.REF_CONTEXT) for b in (b1, b2)]
    assert grow[1] - grow[0] == pytest.approx(y2 - y1, rel=1e-6)
    assert 0.8 < cal.bw_eff < 0.95  # of HBM 3.35 TB/s


def test_allreduce_table_and_beyond() -> None:
    assert modelled.allreduce_ms(1, 1e6) == 0.0
    assert modelled.allreduce_ms(8, 32768) == pytest.approx(7.8e-3)  # SGLang custom all-reduce, TP8, 32 KB
    assert modelled.allreduce_ms(2, 1 << 20) == pytest.approx(19.9e-3)
    assert modelled.allreduce_ms(4, 3 << 20) == pytest.approx((31.1 + 2 * 14 / 3) * 1e-3)  # vLLM TP4 slope
    sizes = [2**k for k in range(8, 25)]
    for tp in (2, 4, 8):
        assert all(modelled.allreduce_ms(tp, b) > 0 for b in sizes)


@pytest.mark.parametrize("fname", sorted(modelled.SHIPPED))
def test_shipped_profiles_are_up_to_date(fname: str) -> None:
    shipped = Profile.from_json(ROOT / "profiles" / fname)
    shape, name = modelled.SHIPPED[fname]
    fresh = modelled.build(shape, name)
    assert shipped.method == "modelled" and shipped.provenance["measured"] == []
    assert shipped.step_latency == fresh.step_latency
    assert shipped.costs == fresh.costs and shipped.kv_capacity == fresh.kv_capacity
    assert {(p.replicas, p.tp) for p in shipped.step_latency} == {(8, 1), (4, 2), (2, 4), (1, 8)}
    assert max(p.batch for p in shipped.step_latency) == 1024
    assert max(p.context for p in shipped.step_latency) == 24576
    bad = {(p.tp, p.batch, p.context) for p in shipped.infeasible_points()}
    assert (1, 1024, 24576) in bad and (8, 1024, 2048) not in bad
    cap = shipped.kv_capacity
    assert cap is not None and cap.tokens(1) < cap.tokens(2) / 2 < cap.tokens(8) / 8  # weights shard
