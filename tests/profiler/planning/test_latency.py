"""LatencyModel: exact on grid points, monotone everywhere, documented extrapolation and fallback;
holdout_error."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from rollout_profiler.planning.latency import LatencyModel, holdout_error
from rollout_profiler.profile import CostModel, ModelShape, Profile, StepPoint
from rollout_profiler.profiling import modelled
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

SHAPE = ModelShape("toy", "LlamaForCausalLM", 64, 2, 8, 8, 8, 128, 100)
COSTS = CostModel(1e6, 1.0, 100.0, 1.0, 1.0, 10.0, 1.0)


def make_profile(
    fns: dict[str, Callable[[int, int], float]],
    batches: tuple[int, ...] = (1, 2, 4, 8),
    contexts: tuple[int, ...] = (100, 200, 400),
) -> Profile:
    pts = [
        StepPoint(Layout.parse(k).replicas, Layout.parse(k).tp, b, c, f(b, c))
        for k, f in fns.items()
        for b in batches
        for c in contexts
    ]
    return Profile("hand", SHAPE, "test", "cpu", 2, "", "float32", "modelled", pts, [], COSTS)


@pytest.fixture(scope="module")
def llama() -> Profile:
    return modelled.build(modelled.LLAMA_31_8B, "llama")


def test_exact_on_grid_points(llama: Profile) -> None:
    m = LatencyModel(llama)
    for p in llama.step_latency:
        assert m.step_ms((p.replicas, p.tp), p.batch, p.context) == pytest.approx(p.ms, rel=1e-12)
        assert m.step_ms(Layout(p.replicas, p.tp), p.batch, p.context) == pytest.approx(p.ms, rel=1e-12)


def test_linear_between_points_and_vectorised_agrees() -> None:
    m = LatencyModel(make_profile({"2x1": lambda b, c: 1.0 + b + c / 100}))
    assert m.step_ms((2, 1), 3, 150) == pytest.approx(1 + 3 + 1.5)  # affine data: bilinear is exact
    bs, cs = np.array([0, 0.5, 1, 3, 7.5, 8, 20]), np.array([50, 100, 150, 300, 400, 401, 1000])
    many = m.step_ms_many((2, 1), bs, cs)
    assert many.tolist() == pytest.approx([m.step_ms((2, 1), b, c) for b, c in zip(bs, cs, strict=True)])


@pytest.mark.parametrize("same_grid", [True, False])
def test_many_layouts_at_once_agree_with_one_at_a_time(llama: Profile, same_grid: bool) -> None:
    prof = llama
    if not same_grid:  # one layout on a grid of its own: evaluated apart from the others
        prof = make_profile({"2x1": lambda b, c: 1.0 + b + c / 100, "1x2": lambda b, c: 2.0 + b / 3})
        pts = [p for p in prof.step_latency if (p.replicas, p.context) != (1, 400)]
        prof = Profile("hand", SHAPE, "test", "cpu", 2, "", "float32", "modelled", pts, [], COSTS)
    m = LatencyModel(prof)
    lays = m.layouts
    rng = np.random.default_rng(1)
    b = np.concatenate([rng.uniform(-1, 3000, (len(lays), 60)), np.zeros((len(lays), 1))], axis=1)
    c = np.concatenate([rng.uniform(0, 60_000, (len(lays), 60)), np.full((len(lays), 1), 9.0)], axis=1)
    got = m.step_ms_layouts(lays, b, c)
    want = [[m.step_ms(lay, x, y) for x, y in zip(b[s], c[s], strict=True)] for s, lay in enumerate(lays)]
    assert got.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-12) for row in want]


def test_monotone_everywhere_including_extrapolation(llama: Profile) -> None:
    m = LatencyModel(llama)
    rng = np.random.default_rng(0)
    b = rng.uniform(0.5, 3000, 400)
    c = rng.uniform(0, 40000, 400)
    for lay in m.layouts:
        base = m.step_ms_many(lay, b, c)
        assert (m.step_ms_many(lay, b * 1.1 + 1, c) >= base - 1e-9).all()
        assert (m.step_ms_many(lay, b, c * 1.1 + 10) >= base - 1e-9).all()


def test_noisy_grid_is_made_monotone() -> None:
    noisy = {(4, 200): 2.0}  # a dip below its neighbours
    m = LatencyModel(make_profile({"2x1": lambda b, c: noisy.get((b, c), 10.0 + b + c / 100)}))
    dip = m.step_ms((2, 1), 4, 200)
    assert dip > 2.0 + 5  # isotonic regression pools the dip with its neighbours...
    assert dip < 10 + 4 + 2.0  # ...averaging it, rather than raising it to the largest neighbour
    for b, c in [(2, 200), (4, 100)]:  # and the fit is monotone around it
        assert m.step_ms((2, 1), b, c) <= dip
    assert m.step_ms((2, 1), 16, 400) == pytest.approx(10 + 16 + 4)  # far points untouched
    assert m.step_ms((2, 1), 4, 200) >= m.step_ms((2, 1), 2, 200)


def test_extrapolation_uses_last_slope_and_never_goes_below() -> None:
    m = LatencyModel(make_profile({"2x1": lambda b, c: 5.0 + 2 * b + c / 100}))
    assert m.step_ms((2, 1), 16, 400) == pytest.approx(5 + 32 + 4)  # batch slope of the last segment
    assert m.step_ms((2, 1), 8, 800) == pytest.approx(5 + 16 + 8)  # context slope of the last segment
    assert m.step_ms((2, 1), 0.5, 10) == pytest.approx(m.step_ms((2, 1), 1, 100))  # clamped below the grid
    assert m.step_ms((2, 1), 0, 100) == 0.0
    flat = LatencyModel(make_profile({"2x1": lambda b, c: 9.0 if b < 8 else 8.0}))  # falls at the edge
    last = flat.step_ms((2, 1), 8, 400)  # the isotonic fit pools the fall with the rows before it
    assert 8.0 < last < 9.0
    assert flat.step_ms((2, 1), 100, 400) == pytest.approx(last)  # never below the last fitted value


def test_fallback_to_nearest_replicas_of_same_tp(caplog: pytest.LogCaptureFixture) -> None:
    m = LatencyModel(make_profile({"4x1": lambda b, c: 3.0 + b, "1x2": lambda b, c: 2.0 + b}))
    assert m.step_ms((2, 1), 2, 100) == pytest.approx(5.0)
    assert m.fallbacks == {(2, 1): (4, 1)}
    assert "2x1 not profiled" in caplog.text
    with pytest.raises(UserError, match="no step latency for TP 4"):
        m.step_ms((1, 4), 1, 100)


def test_holdout_error_zero_on_affine_and_detects_curvature(llama: Profile) -> None:
    affine = holdout_error(make_profile({"2x1": lambda b, c: 1.0 + b + c / 100}))
    assert affine["n"] > 0 and affine["max"] < 1e-12
    curved = holdout_error(make_profile({"2x1": lambda b, c: 1.0 + b * b + c / 100}))
    assert curved["max"] > 0.05
    err = holdout_error(llama)
    assert err["median"] < 0.01 and err["max"] < 0.10, err
