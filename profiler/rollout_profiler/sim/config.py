"""The simulator's configuration (:class:`SimConfig`), a switch a controller asks for (:class:`Switch`) and
the result of a run (:class:`SimResult`). The engine settings the simulator models (``max_batch``,
``page_size``) keep the engine's names, defaults and bounds (``EngineSettings``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.config.engine_settings import DEFAULTS, check_setting
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.planning.policy import ADMISSIONS, PlannerPolicy
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.profile import KVCapacity


@dataclass(frozen=True, slots=True)
class SimConfig:
    gpus: int
    admission: str = "paged"
    decide_every_ms: float = 500.0
    max_batch: int | None = None  # running requests per replica (the engine's max_batch); None: KV memory's
    max_segment: int = 256
    planner: PlannerPolicy | None = None  # default: every profiled layout that fits, default hysteresis
    prior: Prior | None = None
    oracle_per_octave: int = 3
    oracle_replays: int = 60  # budget of the oracles' local search (full replays)
    initial_layout: str = "auto"  # adaptive's start: "auto" (the planner picks), "smallest", or "DxT"
    kv_capacity: KVCapacity | None = None  # default: the profile's
    memory: bool = True  # False: ignore KV capacity (unlimited)
    page_size: int = DEFAULTS.page_size  # tokens per page of the KV pool (``paged`` admission)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.max_segment < 1 or self.oracle_per_octave < 1:
            raise UserError("gpus, max_segment and oracle_per_octave must be >= 1")
        if not self.decide_every_ms > 0:
            raise UserError(f"must be > 0, got {self.decide_every_ms}", "decide_every_ms")
        check_setting("max_batch", self.max_batch)  # the engine's bounds, named as the engine names them
        check_setting("page_size", self.page_size)
        if self.admission not in ADMISSIONS:
            raise UserError(f"must be one of {ADMISSIONS}, got {self.admission!r}", "admission")
        if self.initial_layout not in ("auto", "smallest"):
            lay = Layout.parse(self.initial_layout, "initial_layout")
            if lay.world != self.gpus:
                raise UserError(
                    f"{lay} has {lay.world} ranks, the pod has {self.gpus} GPUs", "initial_layout"
                )


@dataclass(slots=True)
class SimResult:
    policy: str
    latency_s: float
    gpu_busy: float
    reconfigs: list[ReconfigEvent]
    timeline: list[tuple[float, int, int]]  # (time s, unfinished requests, TP)
    detail: str = ""
    admission: str = "paged"
    preemptions: int = 0
    recomputed_tokens: int = 0
    marks: dict[int, float] = field(default_factory=dict)  # unfinished <= n first at ms (oracle)

    @property
    def switch_ms(self) -> float:
        return sum(r.predicted_ms for r in self.reconfigs)

    def adopted(self, policy: str, detail: str, *, free_switches: bool = False) -> SimResult:
        """This run reported under another name (an oracle or a bound that adopts it). With
        ``free_switches`` its switches cost nothing: the same run shifted (its timeline is left as run)."""
        events = list(self.reconfigs)
        latency = self.latency_s
        if free_switches:
            events = [e.model_copy(update={"predicted_ms": 0.0, "actual_ms": 0.0}) for e in events]
            latency -= self.switch_ms / 1e3
        return replace(
            self,
            policy=policy,
            detail=detail,
            latency_s=latency,
            reconfigs=events,
            timeline=list(self.timeline),
        )

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "policy": self.policy,
            "latency_s": self.latency_s,
            "gpu_busy": self.gpu_busy,
            "admission": self.admission,
            "reconfigurations": len(self.reconfigs),
            "switch_ms": self.switch_ms,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "reconfigs": [r.model_dump(mode="json") for r in self.reconfigs],
            "detail": self.detail,
        }
        if timeline:
            d["timeline"] = [list(x) for x in self.timeline]
        return d


@dataclass(frozen=True, slots=True)
class Switch:
    layout: Layout
    method: str
    work: np.ndarray  # per request: remaining work to balance by (only unfinished entries are used)
    reason: str = ""
