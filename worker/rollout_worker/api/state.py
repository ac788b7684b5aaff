"""The engine's state as the planner sees it (``GET /v1/state``), and the other planner-facing bodies.

Published as pydantic models in this torch-free module so that the HTTP server, the sidecar, the planner
loop and the tests share one schema.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.scheduling.costs import Method
from rollout_worker.scheduling.layout import LayoutField


class RunningRequest(BaseModel):
    rid: str
    prompt_len: int
    generated: int
    max_new_tokens: int


class WaitingRequest(BaseModel):
    rid: str
    prompt_len: int
    max_new_tokens: int
    generated: int = Field(0, description="Tokens generated before it went back to waiting (a switch).")


class ReplicaRequests(BaseModel):
    running: list[RunningRequest] = Field(default_factory=list)
    waiting: list[WaitingRequest] = Field(default_factory=list)


class FinishedLengths(BaseModel):
    """Lengths of requests finished after ``since_step`` (the most recent ones, up to a bound)."""

    since_step: int
    lengths: list[int] = Field(default_factory=list)
    capped: list[bool] = Field(default_factory=list, description="Stopped by max_new_tokens.")
    total: int = Field(0, description="Requests finished since the engine started.")
    truncated: bool = Field(False, description="Older finished lengths were dropped (bounded memory).")


class EngineState(BaseModel):
    layout: LayoutField
    step: int = Field(
        description="Monotonic engine clock: +1 per replica step report, driver-side finish and switch. "
        "Pass it back as since_step to get each finished length exactly once."
    )
    time_s: float
    ranks_ready: list[bool]
    paused: bool
    reconfiguring: bool
    step_ms: float | None = Field(None, description="Median of the recent decode steps, ms.")
    replicas: list[ReplicaRequests]
    queued: list[WaitingRequest] = Field(
        default_factory=list, description="Accepted but not yet given to a replica (paused or switching)."
    )
    finished: FinishedLengths
    plan: Plan | None = None
    weight_version: str
    weight_loads: int = Field(
        0,
        description="Weight loads since the engine started: each one a new RL iteration's weights, "
        "whether or not the update named a new weight_version (SGLang's updates keep the version when none "
        "is given).",
    )
    reconfigurations: int


class ReconfigureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    layout: LayoutField
    method: Method = "auto"


class ReconfigureResponse(BaseModel):
    event: ReconfigEvent | None
    layout: LayoutField
    message: str


class PlanResponse(BaseModel):
    plan: Plan | None
    layout: LayoutField
    message: str
