"""The engine's configuration, validated when it is built: the model on its ranks, and the engine's settings
(:class:`rollout_worker.config.engine_settings.EngineSettings`, validated there). Errors name the field
(``layout``, ``max_batch``); callers map fields to their own names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_worker.config.engine_settings import DEFAULTS, DTYPES, EngineSettings, parse_settings
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.errors import UserError
from rollout_worker.scheduling.costs import DEFAULT_COSTS, CostModel
from rollout_worker.scheduling.layout import MAX_RANKS, Layout


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the ranks run: the model and its shape on ``world`` ranks (layouts, dtype) and the engine's
    tunables (``engine``, the one :class:`EngineSettings` every surface derives from)."""

    model_dir: str
    model: ModelConfig
    world: int  # rank processes G
    layout: Layout  # initial layout
    candidates: tuple[Layout, ...] = ()  # () = every layout the model can run on ``world`` ranks
    dtype: str = "float32"
    engine: EngineSettings = DEFAULTS
    costs: CostModel = DEFAULT_COSTS  # priors of the switch-cost model; measured rates replace them
    random_weights: bool = False  # seeded random shards of the right shapes (profiling a shape)

    def __post_init__(self) -> None:
        m = self.model
        if self.world < 1:
            raise UserError(f"must be >= 1, got {self.world}", "ranks")
        if self.world > MAX_RANKS:
            raise UserError(f"must be <= {MAX_RANKS} (the ranks of one engine), got {self.world}", "ranks")
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
        ctx = self.engine.context_length
        if ctx == 0:
            resolved = self.engine.model_copy(update={"context_length": m.max_position_embeddings})
            object.__setattr__(self, "engine", resolved)
        elif ctx > m.max_position_embeddings:
            raise UserError(
                f"{ctx} exceeds max_position_embeddings={m.max_position_embeddings}", "context_length"
            )

    @classmethod
    def load(
        cls,
        model_dir: str,
        world: int,
        layout: Layout | None = None,
        *,
        candidates: tuple[Layout, ...] = (),
        dtype: str = "float32",
        engine: EngineSettings | None = None,
        costs: CostModel = DEFAULT_COSTS,
        **settings: Any,
    ) -> EngineConfig:
        """Read the model's config.json and build a validated config (layout defaults to G x 1). Engine
        settings come as ``engine`` or as keywords of :class:`EngineSettings` (``max_batch=8``)."""
        model = ModelConfig.load(model_dir)
        if engine is None:
            engine = parse_settings(settings)
        elif settings:
            engine = parse_settings({**engine.model_dump(), **settings})
        return cls(
            model_dir=str(model_dir),
            model=model,
            world=world,
            layout=layout or Layout(world, 1),
            candidates=candidates,
            dtype=dtype,
            engine=engine,
            costs=costs,
        )
