"""Layouts: G ranks as D replicas of tensor-parallel size T (D * T = G).

Rank ``r`` serves replica ``r % D`` as shard ``r // D``. Growing T by a factor k then only *slices*
weights a rank already holds (its new shard lies inside its old one), and ``new_group`` (which sorts
ranks) gives each rank its shard index as its group rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
            raise UserError(f"{what}: {text!r} is not of the form DxT (e.g. 2x2)")
        d, t = int(m.group(1)), int(m.group(2))
        if d < 1 or t < 1:
            raise UserError(f"{what}: {text!r} needs D >= 1 and T >= 1")
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


def tp_fits_heads(tp: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why ``tp`` cannot shard these heads, or None when it can."""
    if num_heads % tp:
        return f"TP size {tp} does not divide num_attention_heads={num_heads}"
    if num_kv_heads % tp and tp % num_kv_heads:
        return f"TP size {tp} neither divides nor is a multiple of num_key_value_heads={num_kv_heads}"
    return None


def candidate_layouts(world: int, num_heads: int, num_kv_heads: int) -> list[Layout]:
    """Every layout of ``world`` ranks whose TP size fits the model's heads, smallest TP first."""
    out = []
    for tp in range(1, world + 1):
        if world % tp == 0 and tp_fits_heads(tp, num_heads, num_kv_heads) is None:
            out.append(Layout(world // tp, tp))
    return out


def parse_candidates(text: str, world: int, flag: str = "--candidates") -> list[Layout]:
    layouts = []
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        lay = Layout.parse(part, what=f"{flag} item {i + 1}")
        if lay.world != world:
            raise UserError(f"{flag} item {i + 1}: {lay} has {lay.world} ranks, not {world}")
        layouts.append(lay)
    if not layouts:
        raise UserError(f"{flag}: no layout given")
    return sorted(set(layouts), key=lambda lay: lay.tp)
