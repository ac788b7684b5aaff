"""Speculative decoding as the planner and the simulator see it: the time per token a request emits.

The engine's ``auto`` policy (:mod:`rollout_worker.engine.rank.speculation`) verifies, each step, the draft
width ``w`` (0 to k) with the most expected tokens per unit of step time. With drafted tokens accepted one
after another with probability ``p`` (a workload's acceptance, what ``rolloutctl bench spec`` measures as
tokens a verify step emits), a request emits ``E(w) = 1 + p + ... + p^w`` tokens per step, and a verify
step of ``B`` requests costs about a decode step of ``B (1 + w)`` rows (the profile's step latency at that
batch). So a replica with speculation advances its requests one token in

    ``min over w of step_ms(layout, B (1 + w), context) / E(w)``

(``w = 0``: plain decoding). :class:`SpeculativeLatency` is a :class:`~rollout_profiler.planning.latency.
LatencyModel` that answers this in place of the decode step, so the planner's prediction and the
simulator's steps both include speculation: with it, layout and speculation are chosen together (a TP=1
replica that speculates in the tail may beat a switch to TP=2). A fluid model: the expectation, not the
draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.planning.latency import LatencyModel, LayoutLike
from rollout_profiler.profile import Profile


@dataclass(frozen=True, slots=True)
class Speculation:
    accept: float  # the chance a drafted token is accepted (after the ones before it were)
    draft_tokens: int = 4  # the widest draft verified (the engine's speculative_num_draft_tokens)

    def __post_init__(self) -> None:
        if not 0.0 <= self.accept < 1.0:
            raise UserError(f"must be in [0, 1), got {self.accept}", "spec_accept")
        if not 1 <= self.draft_tokens <= 16:
            raise UserError(f"must be in 1..16, got {self.draft_tokens}", "draft_tokens")

    def tokens(self, width: int) -> float:
        """Expected tokens a request emits in a verify step of ``width`` drafted tokens."""
        return float(sum(self.accept**m for m in range(width + 1)))


class SpeculativeLatency(LatencyModel):
    """The profile's step latency, per token a request emits, with speculation's ``auto`` policy
    (module docstring)."""

    def __init__(self, profile: Profile, spec: Speculation) -> None:
        super().__init__(profile)
        self.spec = spec
        self._widths = [(1 + w, spec.tokens(w)) for w in range(spec.draft_tokens + 1)]

    # (each calls the plain model's method: the decode step of B (1 + w) rows)
    def step_ms(self, layout: LayoutLike, batch: float, context: float) -> float:
        plain = LatencyModel.step_ms
        return min(plain(self, layout, batch * rows, context) / t for rows, t in self._widths)

    def step_ms_many(self, layout: LayoutLike, batch: Any, context: Any) -> np.ndarray:
        plain, b = LatencyModel.step_ms_many, np.asarray(batch, dtype=float)
        return np.min([plain(self, layout, b * rows, context) / t for rows, t in self._widths], axis=0)

    def step_ms_layouts(self, layouts: list[Layout], batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        plain = LatencyModel.step_ms_layouts
        return np.min([plain(self, layouts, batch * rows, context) / t for rows, t in self._widths], axis=0)
