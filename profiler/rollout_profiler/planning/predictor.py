"""Remaining-length predictor for the unfinished requests of a rollout.

Data of one job: finished lengths (exact, except those that hit their cap: right-censored at the cap),
the generated lengths of unfinished requests (right-censored at their current length), and optionally a
prior: lengths from earlier jobs of the same model (:meth:`Prior.from_samples`) or a configured
``lognormal(mu, sigma)`` plus a share that never stops by itself (:meth:`Prior.lognormal`).

The fitted survival ``S(x) = P(natural length > x)`` is spliced from two parts:

* up to ``t*`` (the largest length still observed with ``min_at_risk`` requests at risk): the
  Kaplan-Meier product-limit estimate of this job's data;
* beyond ``t*``: a model tail ``S(t*) * M(x) / M(t*)``. With a prior, ``M`` is the prior shifted in
  log-length by ``delta`` (an accelerated-failure-time fit: penalised censored likelihood over a grid of
  shifts, the penalty ``delta^2 / 2 tau^2`` keeps it at the prior while few requests finished). Without
  a prior, ``M`` is a censored log-normal maximum-likelihood fit (Newton), once ``min_events`` requests
  finished; before that, no request is predicted to stop before its cap.

For a request with ``g`` tokens generated and cap ``C``:
``E[min(L, C) - g | L > g] = integral_g^C S(x) dx / S(g)`` (:meth:`LengthPredictor.expected_remaining`),
and the probability that it still runs ``k`` steps ahead is ``S(g + k) / S(g)`` for ``g + k < C``
(:meth:`LengthPredictor.cond_survival`), which the planner uses for the expected running count.
Everything is numpy-vectorised on a fixed length grid; a fit costs ~1 ms for 1,024 requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rollout_worker.errors import UserError

_SQRT2 = np.sqrt(2.0)
_LOG_SQRT_2PI = 0.5 * np.log(2 * np.pi)


def log_norm_sf(z: np.ndarray) -> np.ndarray:
    """log P(Z > z) for a standard normal (Numerical Recipes erfcc, relative error < 1.2e-7)."""
    x = np.asarray(z, dtype=float) / _SQRT2
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    coef = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418, 0.37409196)
    acc = np.zeros_like(t)
    for c in coef:
        acc = t * (c + acc)
    poly = -a * a - 1.26551223 + t * (1.00002368 + acc)
    log_erfc_pos = np.log(t) + poly
    out = np.where(x >= 0, log_erfc_pos, np.log(np.maximum(2.0 - np.exp(log_erfc_pos), 1e-300)))
    return out - np.log(2.0)


def norm_sf(z: np.ndarray) -> np.ndarray:
    return np.exp(log_norm_sf(z))


@dataclass(frozen=True, slots=True)
class Prior:
    """A length distribution in log-length ``u``: density ``f(u)`` on a grid, ``p_inf`` never stops."""

    u: np.ndarray
    log_f: np.ndarray
    sf: np.ndarray  # P(log L > u)
    p_inf: float
    label: str

    @classmethod
    def lognormal(cls, mu: float, sigma: float, cap_mass: float = 0.0) -> Prior:
        if not sigma > 0 or not 0 <= cap_mass < 1:
            raise UserError(f"prior lognormal needs sigma > 0 and 0 <= cap_mass < 1, got {sigma}, {cap_mass}")
        u = np.linspace(0.0, mu + 8 * sigma, 1024)
        z = (u - mu) / sigma
        log_f = np.log1p(-cap_mass) - 0.5 * z * z - _LOG_SQRT_2PI - np.log(sigma)
        return cls(u, log_f, cap_mass + (1 - cap_mass) * norm_sf(z), cap_mass, f"lognormal({mu:g},{sigma:g})")

    @classmethod
    def from_samples(cls, lengths: np.ndarray, caps: np.ndarray | None = None) -> Prior:
        """Earlier jobs' lengths; those at their cap are the share that would not stop by itself."""
        lens = np.asarray(lengths, dtype=float)
        if lens.size == 0 or (lens < 1).any():
            raise UserError("prior samples: need at least one length, every length >= 1")
        at_cap = np.zeros(lens.shape, bool) if caps is None else lens >= np.asarray(caps, dtype=float)
        y = np.log(lens[~at_cap])
        p_inf = float(at_cap.mean())
        if y.size < 2:
            return cls.lognormal(float(np.log(lens.mean())), 0.5, min(p_inf, 0.99))
        sd = float(y.std())
        iqr = float(np.subtract(*np.percentile(y, [75, 25])))
        h = max(0.9 * min(sd, iqr / 1.34 if iqr > 0 else sd) * y.size**-0.2, 0.02)  # Silverman
        u = np.linspace(0.0, float(y.max()) + 6 * h, 1024)
        hist, edges = np.histogram(y, bins=256)
        mids = (edges[:-1] + edges[1:]) / 2
        z = (u[:, None] - mids[None, :]) / h
        w = hist / y.size
        dens = (np.exp(-0.5 * z * z) / (h * np.sqrt(2 * np.pi))) @ w
        sf = norm_sf(z) @ w
        log_f = np.log(np.maximum((1 - p_inf) * dens, 1e-300))
        return cls(u, log_f, p_inf + (1 - p_inf) * sf, p_inf, f"samples(n={lens.size})")

    def log_sf_at(self, u: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(np.interp(u, self.u, self.sf, left=1.0, right=self.p_inf), 1e-300))

    def log_f_at(self, u: np.ndarray) -> np.ndarray:
        return np.interp(u, self.u, self.log_f, left=-690.0, right=-690.0)


def _kaplan_meier(
    times: np.ndarray, events: np.ndarray, min_at_risk: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Unique times, S just after each, and t* (last time with >= min_at_risk at risk)."""
    if times.size == 0:
        return np.zeros(0), np.zeros(0), 0.0
    ut, inv = np.unique(times, return_inverse=True)
    d = np.bincount(inv, weights=events.astype(float), minlength=ut.size)
    n = np.bincount(inv, minlength=ut.size).astype(float)
    at_risk = times.size - np.concatenate(([0.0], np.cumsum(n)[:-1]))
    surv = np.cumprod(1.0 - d / at_risk)
    ok = np.nonzero(at_risk >= min_at_risk)[0]
    t_star = float(ut[ok[-1]]) if ok.size else 0.0
    return ut, surv, t_star


def fit_lognormal(events: np.ndarray, censored: np.ndarray, iters: int = 50) -> tuple[float, float]:
    """Censored log-normal MLE (Newton with step halving) on lengths >= 1; returns (mu, sigma) of log L."""
    y = np.log(events)
    cu, cw = np.unique(np.log(censored[censored >= 1]), return_counts=True)
    n_e, sy, syy = y.size, float(y.sum()), float((y * y).sum())

    def loglik(mu: float, s: float) -> float:
        ss = syy - 2 * mu * sy + n_e * mu * mu
        return -n_e * np.log(s) - ss / (2 * s * s) + float(cw @ log_norm_sf((cu - mu) / s))

    mu = float(np.median(np.concatenate([y, cu]))) + 0.5
    s = max(float(y.std()) if n_e > 1 else 0.5, 0.1)
    cur = loglik(mu, s)
    for _ in range(iters):
        z = (cu - mu) / s
        lam = np.exp(-0.5 * z * z - _LOG_SQRT_2PI - log_norm_sf(z))
        dlam = lam * (lam - z)
        s1, s2 = sy - n_e * mu, syy - 2 * mu * sy + n_e * mu * mu
        g = np.array([s1 / s**2 + cw @ lam / s, -n_e / s + s2 / s**3 + cw @ (lam * z) / s])
        h_mm = -n_e / s**2 - cw @ dlam / s**2
        h_ms = -2 * s1 / s**3 - cw @ (dlam * z + lam) / s**2
        h_ss = n_e / s**2 - 3 * s2 / s**4 - cw @ (dlam * z * z + 2 * lam * z) / s**2
        hess = np.array([[h_mm, h_ms], [h_ms, h_ss]])
        try:
            step = -np.linalg.solve(hess, g) if np.all(np.linalg.eigvalsh(hess) < 0) else g * 0.01
        except np.linalg.LinAlgError:
            step = g * 0.01
        t = 1.0
        while t > 1e-6:
            nm, ns = mu + t * step[0], max(s + t * step[1], 0.02)
            new = loglik(nm, ns)
            if new >= cur:
                break
            t /= 2
        if t <= 1e-6:
            break
        done = abs(nm - mu) < 1e-7 and abs(ns - s) < 1e-7
        mu, s, cur = nm, ns, new
        if done:
            break
    return mu, s


@dataclass(frozen=True, slots=True)
class LengthPredictor:
    """A fitted survival ``S`` on a linear length grid ``x`` (``cum`` = integral of S from 0)."""

    x: np.ndarray
    surv: np.ndarray
    cum: np.ndarray
    source: str
    n_finished: int

    def survival(self, length: np.ndarray) -> np.ndarray:
        return np.interp(length, self.x, self.surv, right=float(self.surv[-1]))

    def expected_remaining(self, current: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """E[min(L, cap) - current | L > current], in [1, cap - current] (cap - current if S ~ 0)."""
        g = np.asarray(current, dtype=float)
        c = np.asarray(caps, dtype=float)
        sg = self.survival(g)
        num = self._cum_at(c) - self._cum_at(g)
        rem = np.where(sg > 1e-12, num / np.maximum(sg, 1e-12), c - g)
        return np.clip(rem, np.minimum(1.0, c - g), np.maximum(c - g, 0.0))

    def cond_survival(self, current: np.ndarray, caps: np.ndarray, ahead: np.ndarray) -> np.ndarray:
        """P(still running ``ahead[k]`` steps later | running now): shape (len(current), len(ahead))."""
        g = np.asarray(current, dtype=float)[:, None]
        c = np.asarray(caps, dtype=float)[:, None]
        k = np.asarray(ahead, dtype=float)[None, :]
        sg = np.maximum(self.survival(g), 1e-12)
        p = np.minimum(self.survival(g + k) / sg, 1.0)
        return np.where(g + k < c, p, 0.0)

    def _cum_at(self, v: np.ndarray) -> np.ndarray:
        inside = np.interp(v, self.x, self.cum)
        return inside + np.maximum(v - self.x[-1], 0.0) * float(self.surv[-1])


def fit(
    finished: np.ndarray,
    current: np.ndarray,
    caps: np.ndarray,
    finished_caps: np.ndarray | None = None,
    prior: Prior | None = None,
    *,
    min_events: int = 5,
    min_at_risk: int = 20,
    shift_sd: float = 0.25,
    grid: int = 1024,
) -> LengthPredictor:
    """Fit the survival of response lengths from this job's data (and a prior); see the module docstring."""
    fin = np.asarray(finished, dtype=float)
    cur = np.asarray(current, dtype=float)
    cap_arr = np.asarray(caps, dtype=float)
    fcaps = np.full(fin.shape, np.inf) if finished_caps is None else np.asarray(finished_caps, dtype=float)
    hit = fin >= fcaps
    ev_t, cen_t = fin[~hit], np.concatenate([fcaps[hit], cur])
    times = np.concatenate([ev_t, cen_t])
    top = max(float(times.max()) if times.size else 1.0, float(cap_arr.max()) if cap_arr.size else 1.0, 1.0)
    x = np.linspace(0.0, top + 1.0, grid)
    is_event = np.arange(times.size) < ev_t.size
    km_t, km_s, t_star = _kaplan_meier(times, is_event, min_at_risk)
    ev = ev_t[ev_t >= 1]
    if prior is not None:
        delta = _fit_shift(prior, ev, cen_t[cen_t >= 1], shift_sd)
        log_m = prior.log_sf_at(np.log(np.maximum(x, 1.0)) - delta)
        source = f"km+prior {prior.label} shift {delta:+.2f}"
    elif ev.size >= min_events:
        mu, sigma = fit_lognormal(ev, cen_t)
        log_m = log_norm_sf((np.log(np.maximum(x, 1.0)) - mu) / sigma)
        source = f"km+lognormal({mu:.3f},{sigma:.3f})"
    else:
        log_m = np.zeros_like(x)
        source = "km+runs-to-cap"
    idx = np.searchsorted(km_t, x, side="right") - 1
    km = np.where(idx >= 0, km_s[np.maximum(idx, 0)], 1.0) if km_t.size else np.ones_like(x)
    km_star = (
        float(km_s[np.searchsorted(km_t, t_star, side="right") - 1]) if km_t.size and t_star > 0 else 1.0
    )
    log_m_star = float(np.interp(t_star, x, log_m))
    tail = km_star * np.exp(np.minimum(log_m - log_m_star, 0.0))
    surv = np.where(x <= t_star, km, tail)
    cum = np.concatenate([[0.0], np.cumsum((surv[1:] + surv[:-1]) / 2 * np.diff(x))])
    return LengthPredictor(x, surv, cum, source, int(fin.size))


def _fit_shift(prior: Prior, events: np.ndarray, censored: np.ndarray, shift_sd: float) -> float:
    """Penalised censored MLE of a log-length shift of the prior, on a grid of shifts."""
    deltas = np.linspace(-1.0, 1.0, 101)
    ll = -(deltas**2) / (2 * shift_sd**2)
    if events.size:
        hist, edges = np.histogram(np.log(events), bins=min(256, events.size))
        mids = (edges[:-1] + edges[1:]) / 2
        keep = hist > 0
        ll = ll + prior.log_f_at(mids[keep][None, :] - deltas[:, None]) @ hist[keep]
    if censored.size:
        cu, cw = np.unique(np.log(censored), return_counts=True)
        ll = ll + prior.log_sf_at(cu[None, :] - deltas[:, None]) @ cw
    return float(deltas[int(np.argmax(ll))])
