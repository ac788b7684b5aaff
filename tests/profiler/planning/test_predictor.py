"""Remaining-length predictor: censoring handled right, against analytic conditional means."""

from __future__ import annotations

import math

import numpy as np
import pytest
from rollout_profiler.planning.predictor import Prior, fit, log_norm_sf


def true_remaining(mu: float, sigma: float, cap: float, g: float) -> float:
    """E[min(L, cap) - g | L > g] for log-normal L, by numerical integration of the survival."""
    xs = np.linspace(g, cap, 20001)
    sf = np.array([0.5 * math.erfc((math.log(x) - mu) / (sigma * math.sqrt(2))) for x in xs])
    return float(np.sum((sf[1:] + sf[:-1]) / 2 * np.diff(xs)) / sf[0])


def rollout_at_quantile(mu: float, sigma: float, cap: int, q: float, seed: int, n: int = 1024):
    """All requests start together; the shortest q finished, the others are censored at the current step."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.maximum(np.rint(np.exp(mu + sigma * rng.standard_normal(n))), 1), cap)
    step = float(np.quantile(lengths, q))
    fin = lengths[lengths <= step]
    cur = np.full(int((lengths > step).sum()), step)
    return fin, cur, step


CASES = [(8.3, 0.6, 16384), (8.0, 0.8, 8192), (8.28, 0.35, 8192), (7.5, 1.0, 4096)]


@pytest.mark.parametrize(("mu", "sigma", "cap"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quarter_finished_within_10_percent(mu: float, sigma: float, cap: int, seed: int) -> None:
    fin, cur, step = rollout_at_quantile(mu, sigma, cap, 0.25, seed)
    caps = np.full(cur.shape, cap)
    pred = fit(fin, cur, caps, finished_caps=np.full(fin.shape, cap))
    got = pred.expected_remaining(cur, caps)
    assert np.allclose(got, got[0])  # identical requests, identical predictions (vectorised)
    assert got[0] == pytest.approx(true_remaining(mu, sigma, cap, step), rel=0.10)
    assert "lognormal" in pred.source


def test_censoring_matters() -> None:
    """Treating the unfinished as finished (ignoring censoring) would be far off; the fit is not."""
    mu, sigma, cap = 8.3, 0.6, 16384
    fin, cur, step = rollout_at_quantile(mu, sigma, cap, 0.25, 0)
    truth = true_remaining(mu, sigma, cap, step)
    naive = fit(np.concatenate([fin, cur]), np.array([step]), np.array([cap]))
    good = fit(fin, cur, np.full(cur.shape, cap))
    assert abs(naive.expected_remaining(np.array([step]), np.array([cap]))[0] / truth - 1) > 0.3
    assert abs(good.expected_remaining(np.array([step]), np.array([cap]))[0] / truth - 1) < 0.10


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.8])
def test_with_configured_prior(q: float) -> None:
    mu, sigma, cap = 8.0, 0.7, 8192
    fin, cur, step = (
        rollout_at_quantile(mu, sigma, cap, q, 3) if q else (np.zeros(0), np.full(1024, 100.0), 100.0)
    )
    caps = np.full(cur.shape, cap)
    pred = fit(fin, cur, caps, np.full(fin.shape, cap), prior=Prior.lognormal(mu, sigma))
    assert pred.expected_remaining(cur[:1], caps[:1])[0] == pytest.approx(
        true_remaining(mu, sigma, cap, step), rel=0.10
    )
    assert "prior" in pred.source


def test_prior_from_samples_and_cap_mass() -> None:
    mu, sigma, cap = 8.2, 0.5, 8192
    rng = np.random.default_rng(9)
    earlier = np.minimum(np.rint(np.exp(mu + sigma * rng.standard_normal(4096))), cap)
    prior = Prior.from_samples(earlier, np.full(earlier.shape, cap))
    assert prior.p_inf == pytest.approx((earlier >= cap).mean())
    fin, cur, step = rollout_at_quantile(mu, sigma, cap, 0.1, 10)  # this job: 10% finished
    caps = np.full(cur.shape, cap)
    pred = fit(fin, cur, caps, np.full(fin.shape, cap), prior=prior)
    assert pred.expected_remaining(cur[:1], caps[:1])[0] == pytest.approx(
        true_remaining(mu, sigma, cap, step), rel=0.10
    )
    # a job whose requests run longer than the prior says: nothing finished where 10% should have
    late = fit(np.zeros(0), np.full(1024, step), caps[:1].repeat(1024), prior=prior)
    assert late.expected_remaining(cur[:1], caps[:1])[0] > 1.1 * pred.expected_remaining(cur[:1], caps[:1])[0]


def test_no_data_no_prior_runs_to_cap_and_bounds() -> None:
    pred = fit(np.zeros(0), np.array([0.0, 100.0, 500.0]), np.array([1000.0, 1000.0, 600.0]))
    assert pred.expected_remaining(
        np.array([0.0, 100.0, 500.0]), np.array([1000.0, 1000.0, 600.0])
    ).tolist() == (pytest.approx([1000.0, 900.0, 100.0], rel=1e-3))
    fin, cur, step = rollout_at_quantile(8.0, 0.8, 8192, 0.5, 4)
    caps = np.full(cur.shape, 8192)
    pred = fit(fin, cur, caps, np.full(fin.shape, 8192))
    rem = pred.expected_remaining(cur, caps)
    assert ((rem >= 1) & (rem <= 8192 - step)).all()
    k = np.array([0.0, 10, 100, 1000, 8192 - step - 1, 8192 - step, 9000])
    cs = pred.cond_survival(cur[:1], caps[:1], k)[0]
    assert cs[0] == pytest.approx(1.0) and (np.diff(cs) <= 1e-12).all() and cs[-2:].tolist() == [0.0, 0.0]


def test_uncensored_in_range_matches_empirical() -> None:
    """Requests still early (current < most lengths) are predicted from the product-limit estimate."""
    rng = np.random.default_rng(5)
    lengths = np.rint(rng.uniform(100, 1100, 2000))
    fin = lengths[:1500]
    cur = np.full(500, 50.0)
    pred = fit(fin, cur, np.full(500, 5000.0))
    want = float((lengths - 300)[lengths > 300].mean())
    assert pred.expected_remaining(np.array([300.0]), np.array([5000.0]))[0] == pytest.approx(want, rel=0.05)


def test_log_norm_sf_accuracy() -> None:
    z = np.array([-8.0, -3.0, -0.5, 0.0, 0.7, 2.0, 5.0, 10.0, 30.0])
    want = [math.log(0.5 * math.erfc(v / math.sqrt(2))) for v in z]
    assert log_norm_sf(z) == pytest.approx(want, rel=1e-6, abs=1e-9)
