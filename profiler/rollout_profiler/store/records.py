"""Plain, immutable records that the repository functions return (no ORM object leaves a session)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple


@dataclass(frozen=True, slots=True)
class ProfileSummary:
    id: int
    name: str
    model_name: str
    shape_hash: str
    device_kind: str
    device_count: int
    dtype: str
    method: str
    created: str  # the profile's own "created" text
    stored_at: datetime
    step_points: int
    reconfig_points: int


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: int
    name: str
    namespace: str
    spec_hash: str
    model_shape_hash: str
    started_at: datetime
    ended_at: datetime | None
    generation_seconds: float | None
    outcome: str | None


class LengthSample(NamedTuple):
    """One finished request: its output length, and whether the length limit stopped it (censored)."""

    length: int
    capped: bool


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    id: int
    job_id: int | None
    pod: str
    at: datetime
    running_requests: int
    from_layout: str
    to_layout: str
    method: str | None
    predicted_gain_ms: float
    predicted_cost_ms: float
    actual_cost_ms: float | None
    outcome: str
    reason: str
    inputs: dict[str, Any] | None = None
    step: int | None = None
