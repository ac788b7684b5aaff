"""The RolloutJob's status subresource: one pydantic model, the source of the CRD's status schema and what
the operator writes. A reconfiguration lasts milliseconds to seconds: it is a condition and an Event, never a
phase. Names follow the Kubernetes API conventions (camelCase, conditions with reason and message)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Profiling", "Running", "Suspended", "Succeeded", "Failed"]
ConditionType = Literal[
    "Ready", "Progressing", "Reconfiguring", "Degraded", "Suspended", "Complete", "Failed"
]
LAST_DECISIONS = 5  # how many decisions the status keeps (the database keeps all)


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Condition(_Status):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, description="CamelCase, machine-readable.")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339.")
    observed_generation: int | None = None


class PodProgress(_Status):
    index: int = Field(ge=0)
    name: str
    layout: str | None = None
    samples_done: int = Field(0, ge=0)
    samples_total: int = Field(0, ge=0)
    running: int = Field(0, ge=0)
    waiting: int = Field(0, ge=0)
    restarts: int = Field(0, ge=0, description="Times this pod failed and was made again.")
    ready: bool = False
    reachable: bool = Field(False, description="Its sidecar answered the last poll.")
    ip: str | None = None
    uid: str | None = Field(None, description="The pod object these figures are of.")
    reconfigurations: int = Field(
        0, ge=0, description="Switches the pod's engine made (the operator has recorded each)."
    )
    tokens: int = Field(0, ge=0, description="Tokens of the requests the pod's engine finished.")
    step: int = Field(0, ge=0, description="The engine's step at the last poll.")
    last_failed_uid: str | None = Field(None, description="The last failed pod counted in restarts.")
    last_failure: str | None = None


class DecisionRecord(_Status):
    time: str = Field(description="RFC 3339.")
    pod: str
    from_layout: str
    to_layout: str
    method: str
    reason: str
    predicted_gain_ms: float
    predicted_cost_ms: float
    actual_cost_ms: float | None = None
    step: int | None = None


class RolloutJobStatus(_Status):
    phase: Phase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    pods: list[PodProgress] = Field(default_factory=list)
    layout: str | None = Field(None, description="`2x1` when every pod agrees, else the distinct layouts.")
    progress: str | None = Field(None, description="samples done / total, for the printer column.")
    samples_done: int = Field(0, ge=0)
    samples_total: int = Field(0, ge=0)
    tokens: int = Field(0, ge=0, description="Tokens of the finished requests, every pod.")
    reconfigurations: int = Field(0, ge=0)
    last_decisions: list[DecisionRecord] = Field(
        default_factory=list, description=f"The last {LAST_DECISIONS} decisions, newest last."
    )
    start_time: str | None = None
    completion_time: str | None = None
    generation_seconds: float | None = None
    output: str | None = Field(None, description="Where the samples are.")
    message: str | None = Field(None, description="Why the job failed or was refused.")
    layout_plan: str | None = Field(
        None, description="The layouts the pods start at and may switch to: `2x1 (2x1,1x2)`."
    )
    record_id: int | None = Field(None, description="The job's row in the operator's database.")
