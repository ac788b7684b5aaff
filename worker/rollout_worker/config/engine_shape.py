"""The engine's shape: what a job decides and no tunable does (the model, its ranks, its layouts, its dtype).

:class:`EngineShape` is what an engine command's structural options (``--model``, ``--ranks``, ``--layout``,
``--candidates``, ``--dtype``) give, as they were typed; its descriptions are those options' help (flags by
:func:`rollout_worker.config.engine_settings.flag_of`). :meth:`EngineShape.initial_layout` and
:meth:`EngineShape.candidate_layouts` parse the layouts, their errors naming the field. The engine's
tunables are :class:`rollout_worker.config.engine_settings.EngineSettings`; the two together build the
engine's ``EngineConfig``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_worker.config.engine_settings import DTYPES, Dtype, dotted
from rollout_worker.errors import UserError, user_error
from rollout_worker.scheduling.layout import Layout, parse_candidates


class EngineShape(BaseModel):
    """The model on ``ranks`` rank processes: its initial and candidate layouts (``DxT`` text) and dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path = Field(description="Checkpoint directory (config.json, safetensors, tokenizer.json).")
    ranks: int = Field(1, description="Rank processes G (GPUs on a GPU machine).")
    layout: str | None = Field(None, description="Initial layout DxT with D*T = G (default Gx1).")
    candidates: str | None = Field(
        None, description="Layouts the engine may switch to, e.g. 4x1,2x2,1x4 (default: every one that fits)."
    )
    dtype: Dtype = Field("float32", description="The weights' dtype: " + " | ".join(DTYPES) + ".")

    def initial_layout(self) -> Layout:
        """``layout`` parsed, else G x 1 (``ranks`` checked first: errors name the field)."""
        if self.ranks < 1:
            raise UserError(f"must be >= 1, got {self.ranks}", "ranks")
        return Layout.parse(self.layout, "layout") if self.layout else Layout(self.ranks, 1)

    def candidate_layouts(self) -> tuple[Layout, ...]:
        """``candidates`` parsed (each of ``ranks`` ranks), else () (every layout the model can run)."""
        return tuple(parse_candidates(self.candidates, self.ranks)) if self.candidates else ()


def parse_shape(values: dict[str, Any]) -> EngineShape:
    """A validated shape; the first problem becomes a :class:`UserError` naming its field."""
    try:
        return EngineShape(**values)
    except ValidationError as exc:
        raise user_error(exc, dotted) from None
