"""The engine's one validated configuration; CLI flags map onto it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig

KV_METHODS = ("migrate", "recompute", "auto")
_TRIGGER_RE = re.compile(r"^(\d+):(\d+):([a-z]+)$")


@dataclass(frozen=True, slots=True)
class Trigger:
    """When unfinished requests (running + waiting) drop to ``unfinished`` or fewer, switch to TP ``tp``."""

    unfinished: int
    tp: int
    method: str

    @classmethod
    def parse(cls, text: str) -> Trigger:
        m = _TRIGGER_RE.match(text.strip())
        if not m:
            raise UserError(f"--reconfigure: {text!r} is not RUNNING:TP:METHOD (e.g. 12:4:migrate)")
        if m.group(3) not in KV_METHODS:
            raise UserError(f"--reconfigure: {text!r}: method must be one of {', '.join(KV_METHODS)}")
        return cls(int(m.group(1)), int(m.group(2)), m.group(3))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    world: int
    layout: Layout
    candidates: tuple[Layout, ...]
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 64
    kv_budget_tokens: int | None = None  # admission limit on reserved (prompt + max_new) tokens per replica
    max_prefill_tokens: int = 8192
    triggers: tuple[Trigger, ...] = ()
    collective_timeout_s: float = 120.0
    log_every: int = 50
    migrate_bytes_per_ms: float = 200_000.0  # prior until a migration is measured
    recompute_tokens_per_ms: float = 20.0  # prior until a prefill is measured
    fault: str | None = None  # test hook "PHASE:RANK", e.g. "migrate:1": that rank fails mid-phase
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self, model: ModelConfig) -> None:
        if self.world < 1:
            raise UserError(f"--ranks must be >= 1, got {self.world}")
        if self.layout.world != self.world:
            raise UserError(f"--layout {self.layout}: {self.layout.world} ranks, but --ranks is {self.world}")
        for lay in self.candidates:
            why = model.tp_problem(lay.tp)
            if why:
                raise UserError(f"layout {lay}: {why}")
        if self.layout not in self.candidates:
            raise UserError(
                f"--layout {self.layout} is not among the candidate layouts "
                f"({', '.join(map(str, self.candidates))})"
            )
        for trig in self.triggers:
            if self.world % trig.tp:
                raise UserError(f"--reconfigure TP {trig.tp} does not divide --ranks {self.world}")
            target = Layout.for_tp(self.world, trig.tp)
            why = model.tp_problem(trig.tp)
            if why:
                raise UserError(f"--reconfigure {trig.unfinished}:{trig.tp}: {why}")
            if target not in self.candidates:
                raise UserError(f"--reconfigure: layout {target} is not among the candidate layouts")
        if self.max_batch < 1:
            raise UserError("--max-batch must be >= 1")
        if self.dtype not in ("float64", "float32", "bfloat16", "float16"):
            raise UserError(f"--dtype: unknown dtype {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device must be cpu or cuda, got {self.device!r}")

    def fault_rank(self, phase: str) -> int | None:
        if not self.fault:
            return None
        name, _, rank = self.fault.partition(":")
        return int(rank) if name == phase else None
