"""The planner's vocabulary, shared by the planner, the simulator, the engine and its HTTP API: a
:class:`Trigger` ("when unfinished requests drop to n or fewer, switch to layout L with method M"), a
:class:`Plan` (triggers based on a layout), and the :class:`ReconfigEvent` every switch produces.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_worker.errors import FieldAt, UserError
from rollout_worker.scheduling.costs import METHODS, KVMethod, Method
from rollout_worker.scheduling.layout import Layout, LayoutField


class Trigger(BaseModel):
    """When unfinished requests (running + waiting) drop to ``unfinished_at_most`` or fewer, switch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unfinished_at_most: int = Field(ge=0, description="Fire once unfinished requests <= this.")
    layout: LayoutField = Field(description="Target layout DxT.")
    method: Method = Field("auto", description="KV cache: migrate, recompute, or auto (cheaper one).")
    steps_ahead: int | None = Field(None, description="Planner's prediction: steps until it fires.")
    cost_ms: float | None = Field(None, description="Planner's predicted switch cost.")

    def __str__(self) -> str:
        return f"when unfinished <= {self.unfinished_at_most}, switch to {self.layout} ({self.method})"

    @classmethod
    def from_text(cls, text: str, world: int, field: str = "trigger") -> Trigger:
        """``RUNNING:TP:METHOD`` (e.g. ``12:4:migrate``) on ``world`` ranks."""
        m = re.fullmatch(r"\s*(\d+):(\d+):([a-z]+)\s*", text)
        if not m:
            raise UserError(f"{text!r} is not RUNNING:TP:METHOD (e.g. 12:4:migrate)", field)
        n, tp, method = int(m.group(1)), int(m.group(2)), m.group(3)
        if method not in METHODS:
            raise UserError(f"{text!r}: method must be one of {', '.join(METHODS)}", field)
        if tp < 1 or world % tp:
            raise UserError(f"{text!r}: TP size {tp} must be >= 1 and divide the {world} ranks", field)
        return cls.model_validate(
            {"unfinished_at_most": n, "layout": Layout(world // tp, tp), "method": method}
        )


class Plan(BaseModel):
    """Triggers executed at the step each fires; valid only while the engine is in ``based_on_layout``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    based_on_layout: LayoutField
    triggers: list[Trigger] = Field(default_factory=list, max_length=64)

    @field_validator("triggers")
    @classmethod
    def _one_per_threshold(cls, triggers: list[Trigger]) -> list[Trigger]:
        """Two triggers at one threshold: only one could ever fire (see :meth:`fire`), so it is refused."""
        first: dict[int, int] = {}
        for i, t in enumerate(triggers):
            j = first.setdefault(t.unfinished_at_most, i)
            if j != i:
                raise FieldAt(
                    (i, "unfinished_at_most"), f"{t.unfinished_at_most} is the threshold of trigger {j} too"
                )
        return triggers

    def fire(self, unfinished: int, layout: Layout) -> tuple[Trigger | None, Plan | None]:
        """The trigger that fires with ``unfinished`` requests left in ``layout`` (None: none is due, or the
        one due asks for ``layout`` itself), and the plan left after it (None: nothing is). The lowest
        threshold reached fires: one switch, not a chain of switches, when unfinished requests dropped past
        several thresholds at once; triggers at or above it are used up. The engine and the simulator fire
        plans by this rule."""
        reached = [t for t in self.triggers if unfinished <= t.unfinished_at_most]
        if not reached:
            return None, self
        trig = min(reached, key=lambda t: t.unfinished_at_most)
        rest = [t for t in self.triggers if t.unfinished_at_most < trig.unfinished_at_most]
        left = self.model_copy(update={"triggers": rest}) if rest else None
        return (None if trig.layout == layout else trig), left


class ReconfigEvent(BaseModel):
    """One layout switch, as the engine ran it or the simulator modelled it."""

    model_config = ConfigDict(extra="forbid")

    step: int
    time_s: float = Field(description="Seconds since the engine (or simulation) started.")
    src: LayoutField
    dst: LayoutField
    requested: Method
    method: KVMethod
    reason: str
    outcome: Literal["committed", "rolled_back"] = "committed"
    error: str | None = None
    requests_running: int = Field(0, description="Requests whose KV cache was carried over.")
    requests_waiting: int = Field(0, description="Unfinished requests that wait in the new layout.")
    requests_mid_decode: int = Field(0, description="Carried requests that had generated tokens.")
    kv_bytes_moved: int = 0
    kv_pages_moved: int = 0
    kv_tokens_recomputed: int = 0
    weights: dict[str, int] = Field(default_factory=dict, description="sliced, gathered, bytes_received")
    predicted_ms: float = Field(0.0, description="Whole switch, by the cost model, before it ran.")
    predicted_migrate_ms: float = 0.0
    predicted_recompute_ms: float = 0.0
    actual_ms: float | None = Field(None, description="Whole switch, wall clock.")
    phases: dict[str, float] = Field(default_factory=dict, description="Milliseconds per phase.")
