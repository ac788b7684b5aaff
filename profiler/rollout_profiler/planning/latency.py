"""Decode-step latency model built from a :class:`~rollout_profiler.profile.Profile`.

``LatencyModel(profile).step_ms(layout, batch, context)`` is the latency of one decode step of one replica
of ``layout`` (``Layout`` or ``(replicas, tp)``) holding ``batch`` running requests of mean ``context``
tokens.

Interpolation, per profiled layout, on its (batch x context) grid:

* the grid values are first made monotone by isotonic regression (pool-adjacent-violators, alternating
  along batch and context), so noise is averaged rather than amplified, and the model is exact on the
  grid points of a monotone profile;
* bilinear inside the grid, *linear in batch* (not in log2(batch)): at a fixed context a decode step is
  close to affine in batch (weights read once + per-request KV and overheads), and linear interpolation
  is exact on affine segments where log2 interpolation overestimates between grid points;
* beyond the largest batch or context: linear continuation with the last segment's slope (clamped at
  >= 0), so an extrapolated value is never below the last measured one; the last context slope is made
  non-decreasing in batch so that extrapolated rows stay monotone in batch;
* below the smallest batch or context: the first grid value (no downward extrapolation); ``batch <= 0``
  is an idle replica and costs 0 ms.

A layout ``D x T`` that is not profiled falls back to the profiled layout with the same ``T`` and the
nearest replica count (logged once, recorded in ``fallbacks``). A ``T`` with no profiled layout at all is
a :class:`UserError`.

Speed: tables are plain Python lists searched with :mod:`bisect` for scalar calls (~1-2 us), and numpy
arrays for :meth:`LatencyModel.step_ms_many` (one call for a whole vector of points).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

import numpy as np
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.profile import Profile

log = logging.getLogger(__name__)

LayoutLike = Layout | tuple[int, int]


def _pav(y: list[float]) -> list[float]:
    """Pool-adjacent-violators: the least-squares non-decreasing fit of ``y``."""
    blocks: list[list[float]] = []  # [sum, count]
    for x in y:
        blocks.append([x, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    out: list[float] = []
    for s, n in blocks:
        out += [s / n] * int(n)
    return out


def _isotonic_2d(v: list[list[float]], rounds: int = 8) -> list[list[float]]:
    """Monotone (non-decreasing in batch and in context) fit of a noisy grid: alternating 1-D isotonic
    regressions along both axes. A monotone grid is returned unchanged; noise is averaged, not maxed."""
    v = [row[:] for row in v]
    for _ in range(rounds):
        for j in range(len(v[0])):
            col = _pav([row[j] for row in v])
            for i, x in enumerate(col):
                v[i][j] = x
        v = [_pav(row) for row in v]
    return v


@dataclass(slots=True)
class _Table:
    """One layout's monotone grid: ``v[i][j]`` = ms at ``batches[i]``, ``contexts[j]``."""

    batches: list[float]
    contexts: list[float]
    v: list[list[float]]
    ctx_slope: list[float]  # per batch row: ms per context token beyond the last context
    b_arr: np.ndarray
    c_arr: np.ndarray
    v_arr: np.ndarray
    cs_arr: np.ndarray

    @classmethod
    def build(cls, points: dict[tuple[int, int], float], where: str) -> _Table:
        batches = sorted({b for b, _ in points})
        contexts = sorted({c for _, c in points})
        missing = [(b, c) for b in batches for c in contexts if (b, c) not in points]
        if missing:
            raise UserError(
                f"{where}: step_latency grid is not rectangular, missing (batch, context) {missing[:3]}"
            )
        v = _isotonic_2d([[points[(b, c)] for c in contexts] for b in batches])
        for i in range(len(batches)):  # exact monotonicity after the fit: running max along batch, context
            for j in range(len(contexts)):
                if i:
                    v[i][j] = max(v[i][j], v[i - 1][j])
                if j:
                    v[i][j] = max(v[i][j], v[i][j - 1])
        slopes: list[float] = []
        for row in v:
            s = (row[-1] - row[-2]) / (contexts[-1] - contexts[-2]) if len(contexts) > 1 else 0.0
            slopes.append(max(s, slopes[-1] if slopes else 0.0))
        return cls(
            batches=[float(b) for b in batches],
            contexts=[float(c) for c in contexts],
            v=v,
            ctx_slope=slopes,
            b_arr=np.asarray(batches, dtype=float),
            c_arr=np.asarray(contexts, dtype=float),
            v_arr=np.asarray(v, dtype=float),
            cs_arr=np.asarray(slopes, dtype=float),
        )

    def _row(self, i: int, c: float) -> float:
        cs, row = self.contexts, self.v[i]
        if c <= cs[0]:
            return row[0]
        n = len(cs)
        if c >= cs[-1]:
            return row[-1] + self.ctx_slope[i] * (c - cs[-1])
        j = bisect_right(cs, c) - 1
        f = (c - cs[j]) / (cs[j + 1] - cs[j])
        return row[j] + f * (row[j + 1] - row[j]) if j + 1 < n else row[j]

    def value(self, b: float, c: float) -> float:
        if b <= 0:
            return 0.0
        bs = self.batches
        if b <= bs[0] or len(bs) == 1:
            return self._row(0, c)
        if b >= bs[-1]:
            hi, lo = self._row(len(bs) - 1, c), self._row(len(bs) - 2, c)
            return hi + max(0.0, (hi - lo) / (bs[-1] - bs[-2])) * (b - bs[-1])
        i = bisect_right(bs, b) - 1
        lo, hi = self._row(i, c), self._row(i + 1, c)
        return lo + (b - bs[i]) / (bs[i + 1] - bs[i]) * (hi - lo)

    def _rows_at(self, i: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Batch rows ``i`` evaluated at contexts ``c`` (one row per point), as :meth:`_row`."""
        cs, v = self.c_arr, self.v_arr
        if len(cs) == 1:
            return v[i, 0]
        j = np.clip(np.searchsorted(cs, c, side="right") - 1, 0, len(cs) - 2)
        f = np.clip((c - cs[j]) / (cs[j + 1] - cs[j]), 0.0, 1.0)
        lo = v[i, j]
        return lo + f * (v[i, j + 1] - lo) + self.cs_arr[i] * np.maximum(c - cs[-1], 0.0)

    def value_many(self, b: np.ndarray, c: np.ndarray, rows: np.ndarray | int = 0) -> np.ndarray:
        """:meth:`value` at each point; ``rows``: the first row of each point's grid in a stack of grids
        (:meth:`stacked`)."""
        bs = self.b_arr
        if len(bs) == 1:
            out = self._rows_at(np.zeros(c.shape, dtype=np.intp) + rows, c)
        else:
            bb = np.maximum(b, bs[0])
            i = np.minimum(np.searchsorted(bs, bb, side="right") - 1, len(bs) - 2) + rows
            lo, hi = self._rows_at(i, c), self._rows_at(i + 1, c)
            i = i - rows
            f = (bb - bs[i]) / (bs[i + 1] - bs[i])
            f = np.where(f > 1.0, 1.0 + (f - 1.0) * (hi >= lo), f)  # beyond the grid: slope >= 0
            out = lo + f * (hi - lo)
        return np.where(b > 0, out, 0.0)

    @classmethod
    def stacked(cls, tables: list[_Table]) -> _Table | None:
        """One table holding the rows of ``tables`` one grid after another, when they share their batch and
        context grid (else None): many layouts' points evaluated in one call."""
        first = tables[0]
        if any(t.batches != first.batches or t.contexts != first.contexts for t in tables[1:]):
            return None
        v = [row for t in tables for row in t.v]
        slopes = [x for t in tables for x in t.ctx_slope]
        return cls(first.batches, first.contexts, v, slopes, first.b_arr, first.c_arr,
                   np.asarray(v, dtype=float), np.asarray(slopes, dtype=float))  # fmt: skip


class LatencyModel:
    """Step latency per layout from a profile's ``step_latency`` points (see the module docstring)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        grids: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
        for p in profile.step_latency:
            grids.setdefault((p.replicas, p.tp), {})[(p.batch, p.context)] = p.ms
        self._tables = {
            key: _Table.build(pts, f"{profile.name} layout {key[0]}x{key[1]}") for key, pts in grids.items()
        }
        self.fallbacks: dict[tuple[int, int], tuple[int, int]] = {}
        self._stacks: dict[tuple[Layout, ...], _Table | None] = {}

    @property
    def layouts(self) -> list[Layout]:
        return sorted((Layout(d, t) for d, t in self._tables), key=lambda lay: (lay.tp, lay.replicas))

    def table(self, layout: LayoutLike) -> _Table:
        key = (layout.replicas, layout.tp) if isinstance(layout, Layout) else (int(layout[0]), int(layout[1]))
        tab = self._tables.get(key)
        if tab is not None:
            return tab
        same_tp = [k for k in self._tables if k[1] == key[1]]
        if not same_tp:
            have = sorted({t for _, t in self._tables})
            raise UserError(
                f"profile {self.profile.name!r} has no step latency for TP {key[1]} (profiled TP: {have})"
            )
        near = min(same_tp, key=lambda k: (abs(k[0] - key[0]), k[0]))
        if key not in self.fallbacks:
            log.warning("layout %dx%d not profiled: using %dx%d (same TP, nearest replicas)", *key, *near)
        self.fallbacks[key] = near
        self._tables[key] = self._tables[near]
        return self._tables[near]

    def step_ms(self, layout: LayoutLike, batch: float, context: float) -> float:
        return self.table(layout).value(float(batch), float(context))

    def step_ms_many(self, layout: LayoutLike, batch: Any, context: Any) -> np.ndarray:
        b, c = batch, context
        if not (
            isinstance(b, np.ndarray) and isinstance(c, np.ndarray) and b.shape == c.shape and b.ndim == 1
        ):
            b, c = np.broadcast_arrays(
                np.atleast_1d(np.asarray(b, dtype=float)), np.atleast_1d(np.asarray(c, dtype=float))
            )
        return self.table(layout).value_many(b, c)

    def step_ms_layouts(self, layouts: list[Layout], batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        """:meth:`step_ms_many` of ``layouts[s]`` at ``batch[s]``, ``context[s]`` (rows of 2-D arrays), in one
        evaluation when the layouts' grids are alike."""
        key = tuple(layouts)
        if key not in self._stacks:
            self._stacks[key] = _Table.stacked([self.table(lay) for lay in layouts])
        stack = self._stacks[key]
        if stack is None:
            return np.stack(
                [LatencyModel.step_ms_many(self, lay, batch[s], context[s]) for s, lay in enumerate(layouts)]
            )  # (this class's: a subclass's step_ms_many may answer another question)
        rows = np.repeat(np.arange(len(layouts)) * len(stack.batches), batch.shape[1])
        out = stack.value_many(batch.ravel(), context.ravel(), rows)
        return out.reshape(batch.shape)


def holdout_error(profile: Profile) -> dict[str, Any]:
    """Held-out relative error of the latency model against the *raw* measurements.

    For each profiled layout, each interior batch row (and, separately, each interior context column)
    is removed from the profile, a model is built from the remaining points, and the removed points are
    predicted and compared with their measured values: ``|predicted - measured| / measured``.
    Returns ``{"n", "median", "mean", "max", "per_layout": {"DxT": {...}}}`` (0.05 = 5%).
    """
    pooled: list[float] = []
    per_layout: dict[str, dict[str, float]] = {}
    layouts = sorted({(p.replicas, p.tp) for p in profile.step_latency})
    for d, t in layouts:
        mine = [p for p in profile.step_latency if (p.replicas, p.tp) == (d, t)]
        errs: list[float] = []
        for axis in ("batch", "context"):
            values = sorted({getattr(p, axis) for p in mine})
            for held in values[1:-1]:
                keep = [
                    p
                    for p in profile.step_latency
                    if (p.replicas, p.tp) != (d, t) or getattr(p, axis) != held
                ]
                model = LatencyModel(replace(profile, step_latency=keep))
                for p in mine:
                    if getattr(p, axis) == held:
                        errs.append(abs(model.step_ms((d, t), p.batch, p.context) - p.ms) / p.ms)
        if errs:
            per_layout[f"{d}x{t}"] = {"n": len(errs), "median": median(errs), "max": max(errs)}
        pooled += errs
    if not pooled:
        return {"n": 0, "median": float("nan"), "mean": float("nan"), "max": float("nan"), "per_layout": {}}
    return {
        "n": len(pooled),
        "median": median(pooled),
        "mean": sum(pooled) / len(pooled),
        "max": max(pooled),
        "per_layout": per_layout,
    }
