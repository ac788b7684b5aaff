"""What the planner is given: the pod's state as it sees it (:class:`PodSnapshot` of :class:`ReplicaState`),
the job's settings (:class:`PlannerPolicy`) and the last switch (:class:`LastSwitch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rollout_worker.errors import UserError
from rollout_worker.scheduling.costs import METHODS
from rollout_worker.scheduling.layout import Layout


@dataclass(frozen=True, slots=True)
class ReplicaState:
    prompt_len: np.ndarray  # per running request
    generated: np.ndarray
    cap: np.ndarray  # max_new_tokens
    waiting: int = 0  # waiting requests known by number only (the snapshot's waiting_* stand for each)
    wait_prompt_len: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per waiting request known
    wait_generated: np.ndarray = field(default_factory=lambda: np.zeros(0))  # one by one (a retracted or
    wait_cap: np.ndarray = field(default_factory=lambda: np.zeros(0))  # moved one keeps its tokens)

    @property
    def unfinished(self) -> int:
        return len(self.generated) + len(self.wait_generated) + self.waiting


@dataclass(frozen=True, slots=True)
class PodSnapshot:
    layout: Layout
    replicas: tuple[ReplicaState, ...]
    ready: tuple[bool, ...]  # per rank
    step: int = 0
    time_s: float = 0.0
    waiting_prompt_len: int = 256  # assumed for waiting requests
    waiting_cap: int | None = None  # assumed for waiting requests (default: the largest running cap)


# How a replica admits requests into its KV memory: "engine", the pre-paged engine's rule (prompt +
# max_new_tokens reserved); "sglang", tokens used, the newest preempted; "paged", the engine's paged pool
# (scheduling/admission: optimistic admission, the fewest-decoded retracted). The planner prices "paged" by
# its pressure model (rollout_profiler.planning.forecast), "sglang" by the tokens held.
ADMISSIONS = ("engine", "sglang", "paged")


@dataclass(frozen=True, slots=True)
class PlannerPolicy:
    """The planner's settings. A switch must gain more than its cost x (1 + ``margin``) plus the larger of
    ``min_gain_ms`` and ``min_gain_fraction`` x the predicted time left (the predictor's typical error: a
    smaller gain is noise); ``kv_tokens_per_replica`` and ``max_batch_per_replica`` are what a replica of
    each TP size holds and runs, ``admission`` how it admits (:data:`ADMISSIONS`)."""

    candidates: tuple[Layout, ...]
    margin: float = 0.1
    min_gain_ms: float = 50.0
    min_gain_fraction: float = 0.01  # ... and at least this fraction of the predicted time left
    cooldown_s: float | None = None  # None: COOLDOWN_SWITCHES x the last switch's duration
    cooldown_steps: int = 0
    method: str = "auto"
    allow_shrink: bool = False
    max_batch_per_replica: int | None = None
    chunks: int = 32
    kv_tokens_per_replica: tuple[tuple[int, int], ...] = ()  # (TP size, KV tokens); absent: unlimited
    admission: str = "paged"  # one of ADMISSIONS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"must be one of {METHODS}, got {self.method!r}", "method")
        gains = (self.margin, self.min_gain_ms, self.min_gain_fraction, self.cooldown_s or 0.0)
        if min(gains) < 0 or self.chunks < 1:
            raise UserError(
                "margin, min_gain_ms, min_gain_fraction, cooldown_s must be >= 0, chunks >= 1", "planner"
            )
        if self.admission not in ADMISSIONS:
            raise UserError(f"must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}", "admission")


# The default cooldown, in switches: after a switch that took C seconds, none for this many times C. The
# hysteresis asks each switch's predicted gain to beat its cost; the cooldown keeps noise in the prediction
# (a retraction, a burst of finishes) from buying a second switch before the first has paid off.
COOLDOWN_SWITCHES = 10.0


@dataclass(frozen=True, slots=True)
class LastSwitch:
    step: int
    time_s: float  # committed at
    cost_s: float = 0.0  # how long it took

    def cooldown_s(self, policy: PlannerPolicy) -> float:
        """Seconds from this switch to the next: the policy's, or by default from this switch's cost."""
        return COOLDOWN_SWITCHES * self.cost_s if policy.cooldown_s is None else policy.cooldown_s
