"""Layouts: G ranks as D replicas of tensor-parallel size T (D * T = G).

Rank ``r`` serves replica ``r % D`` as shard ``r // D``. Growing T by a factor k then only *slices*
weights a rank already holds (its new shard lies inside its old one), and ``new_group`` (which sorts
ranks) gives each rank its shard index as its group rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

from rollout_worker.errors import UserError

_LAYOUT_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    replicas: int  # D
    tp: int  # T

    @property
    def world(self) -> int:
        return self.replicas * self.tp

    def __str__(self) -> str:
        return f"{self.replicas}x{self.tp}"

    @classmethod
    def parse(cls, text: str, what: str = "layout") -> Layout:
        m = _LAYOUT_RE.match(text)
        if not m:
            raise UserError(f"{text!r} is not of the form DxT (e.g. 2x2)", what)
        d, t = int(m.group(1)), int(m.group(2))
        if d < 1 or t < 1:
            raise UserError(f"{text!r} needs D >= 1 and T >= 1", what)
        return cls(d, t)

    @classmethod
    def for_tp(cls, world: int, tp: int) -> Layout:
        if tp < 1 or world % tp:
            raise UserError(f"TP size {tp} does not divide the number of ranks {world}")
        return cls(world // tp, tp)

    def replica_of(self, rank: int) -> int:
        return rank % self.replicas

    def shard_of(self, rank: int) -> int:
        return rank // self.replicas

    def ranks_of(self, replica: int) -> list[int]:
        """Ranks of one replica, ordered by shard index."""
        return [replica + s * self.replicas for s in range(self.tp)]

    def groups(self) -> list[list[int]]:
        return [self.ranks_of(d) for d in range(self.replicas)]


MAX_RANKS = 64  # rank processes of one engine: a pod's GPUs (the job's gpusPerPod, an engine's --ranks)


def tp_problem(tp: int, num_heads: int, vocab_size: int) -> str | None:
    """Why a model of this shape cannot run at TP size ``tp`` (heads, vocabulary), or None when it can.

    Head counts need not divide ``tp``: shards own uneven whole heads
    (:mod:`rollout_worker.scheduling.head_shards`),
    as long as every shard gets a query head. The vocabulary is split evenly (its logits are all-gathered).
    """
    if tp < 1:
        return f"TP size {tp} must be >= 1"
    if tp > num_heads:
        return f"TP size {tp} exceeds num_attention_heads={num_heads}: a rank would hold no query head"
    if vocab_size % tp:
        return f"TP size {tp} does not divide vocab_size={vocab_size}"
    return None


def candidate_layouts(world: int, num_heads: int, vocab_size: int) -> list[Layout]:
    """Every layout of ``world`` ranks a model of this shape can run, smallest TP first. The one function
    that says which layouts exist: the engine, the planner and the simulator all call it."""
    return [
        Layout(world // tp, tp)
        for tp in range(1, min(world, num_heads) + 1)  # (a larger TP size leaves a rank without a head)
        if world % tp == 0 and tp_problem(tp, num_heads, vocab_size) is None
    ]


def parse_candidates(text: str, world: int, field: str = "candidates") -> list[Layout]:
    layouts = []
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        lay = Layout.parse(part, what=f"{field}[{i}]")
        if lay.world != world:
            raise UserError(f"{lay} has {lay.world} ranks, not {world}", f"{field}[{i}]")
        layouts.append(lay)
    if not layouts:
        raise UserError("no layout given", field)
    return sorted(set(layouts), key=lambda lay: lay.tp)


def coerce_layout(value: object) -> object:
    """A pydantic validator's step: "DxT" parsed into a Layout (Layout's own parser, its message as pydantic's
    ValueError, so the error names the field's path); anything else passed on."""
    if not isinstance(value, str):
        return value
    try:
        return Layout.parse(value)
    except UserError as exc:  # pydantic reports a ValueError with the field's own path
        raise ValueError(exc.message) from None


# A Layout in pydantic models: "DxT" in JSON, a Layout in Python.
LayoutField = Annotated[
    Layout,
    BeforeValidator(coerce_layout),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string", "pattern": r"^\s*\d+\s*[xX]\s*\d+\s*$", "examples": ["2x2"]}),
]
