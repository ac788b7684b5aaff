"""The modelled profiles: calibration points reproduced, shipped files up to date."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_profiler.profile import Profile
from rollout_profiler.profiling import modelled

ROOT = Path(__file__).resolve().parents[3]


def test_modelled_reproduces_published_points() -> None:
    hw, cal = modelled.Hardware(), modelled.calibrate()
    for tp, batch, ms in modelled.REFERENCE_POINTS:
        got = modelled.step_ms(modelled.LLAMA_31_8B, hw, cal, tp, batch, modelled.REF_CONTEXT)
        assert got == pytest.approx(ms, rel=0.15)


@pytest.mark.parametrize("fname", sorted(modelled.SHIPPED))
def test_shipped_profiles_are_up_to_date(fname: str) -> None:
    shipped = Profile.from_json(ROOT / "profiles" / fname)
    shape, name = modelled.SHIPPED[fname]
    fresh = modelled.build(shape, name)
    assert shipped.method == "modelled" and shipped.provenance["measured"] == []
    assert shipped.step_latency == fresh.step_latency
    assert shipped.costs == fresh.costs
    assert {(p.replicas, p.tp) for p in shipped.step_latency} == {(8, 1), (4, 2), (2, 4), (1, 8)}
