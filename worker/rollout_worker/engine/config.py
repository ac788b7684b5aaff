"""The engine's one configuration, validated when it is built. CLI flags and server settings map onto it;
its errors name the field (``layout``, ``max_batch``), and callers map fields to their own names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_worker.api.costs import DEFAULT_COSTS, CostModel
from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig

DTYPES = ("float64", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    model: ModelConfig
    world: int  # rank processes G
    layout: Layout  # initial layout
    candidates: tuple[Layout, ...] = ()  # () = every layout the model can run on ``world`` ranks
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 64  # running requests per replica
    kv_budget_tokens: int | None = None  # reserved (prompt + max_new) tokens per replica
    max_prefill_tokens: int = 8192  # tokens prefilled in one step (at least one request)
    context_length: int = 0  # 0 = the model's max_position_embeddings
    collective_timeout_s: float = 120.0
    costs: CostModel = DEFAULT_COSTS  # priors of the switch-cost model; measured rates replace them
    random_weights: bool = False  # seeded random shards of the right shapes (profiling a shape)
    # Replay decode steps from CUDA graphs (CUDA, TP=1 replicas; else eager). Off by default until it has
    # run on a GPU: no GPU was lent to the session that wrote it (bench/cuda.sh runs its tests and table).
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        m = self.model
        if self.world < 1:
            raise UserError(f"must be >= 1, got {self.world}", "ranks")
        if self.layout.world != self.world:
            raise UserError(
                f"{self.layout} uses {self.layout.world} ranks (D x T), but the engine has {self.world}",
                "layout",
            )
        why = m.tp_problem(self.layout.tp)
        if why:
            raise UserError(f"{self.layout}: {why}", "layout")
        if not self.candidates:
            object.__setattr__(self, "candidates", tuple(m.candidate_layouts(self.world)))
        for i, lay in enumerate(self.candidates):
            if lay.world != self.world:
                raise UserError(f"{lay} has {lay.world} ranks, not {self.world}", f"candidates[{i}]")
            why = m.tp_problem(lay.tp)
            if why:
                raise UserError(f"{lay}: {why}", f"candidates[{i}]")
        if self.layout not in self.candidates:
            raise UserError(
                f"{self.layout} is not among the candidate layouts ({', '.join(map(str, self.candidates))})",
                "layout",
            )
        if self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}", "dtype")
        if self.device not in DEVICES:
            raise UserError(f"must be cpu or cuda, got {self.device!r}", "device")
        if self.max_batch < 1:
            raise UserError(f"must be >= 1, got {self.max_batch}", "max_batch")
        if self.max_prefill_tokens < 1:
            raise UserError(f"must be >= 1, got {self.max_prefill_tokens}", "max_prefill_tokens")
        if not self.collective_timeout_s > 0:
            raise UserError(f"must be > 0 seconds, got {self.collective_timeout_s}", "collective_timeout_s")
        if self.context_length < 0:
            raise UserError(f"must be >= 0 (0: the model's), got {self.context_length}", "context_length")
        if self.context_length == 0:
            object.__setattr__(self, "context_length", m.max_position_embeddings)
        elif self.context_length > m.max_position_embeddings:
            raise UserError(
                f"{self.context_length} exceeds max_position_embeddings={m.max_position_embeddings}",
                "context_length",
            )
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 2:
            raise UserError(f"must be >= 2 tokens, got {self.kv_budget_tokens}", "kv_budget_tokens")

    @classmethod
    def load(cls, model_dir: str, world: int, layout: Layout | None = None, **kw: Any) -> EngineConfig:
        """Read the model's config.json and build a validated config (layout defaults to G x 1)."""
        model = ModelConfig.load(model_dir)
        return cls(
            model_dir=str(model_dir), model=model, world=world, layout=layout or Layout(world, 1), **kw
        )
