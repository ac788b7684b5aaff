"""Pure sharding: which slice of each full tensor a (TP size, shard index) holds, and how to go from
one TP size to another. No processes, no I/O: everything here is unit-tested directly.

A shard is a contiguous range along one dimension ("column-parallel": rows of an [out, in] weight;
"row-parallel": columns). Attention is split by whole heads, unevenly when the head counts do not divide
the TP size (:mod:`rollout_worker.scheduling.head_shards` says which heads each shard owns and why); KV heads
are
duplicated when TP exceeds their number: shard ``s`` of ``T`` then holds KV head ``s * KV // T``. The MLP's
intermediate dimension and the vocabulary are split into near-equal parts (:func:`~.heads.split`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.scheduling import head_shards
from rollout_worker.scheduling.layout import Layout

Kind = Literal["replicated", "col", "row"]


@dataclass(frozen=True, slots=True)
class ShardRange:
    dim: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def contains(self, other: ShardRange) -> bool:
        return self.dim == other.dim and self.start <= other.start and other.stop <= self.stop


def kv_head_range(cfg: ModelConfig, tp: int, shard: int) -> tuple[int, int]:
    """KV heads [lo, hi) held by ``shard`` of ``tp`` (one duplicated head when tp > KV heads)."""
    return head_shards.kv_head_range(cfg.num_kv_heads, tp, shard)


def q_head_range(cfg: ModelConfig, tp: int, shard: int) -> tuple[int, int]:
    """Query heads [lo, hi) of ``shard`` of ``tp``: those of its KV heads, or its part of one group."""
    return head_shards.q_head_range(cfg.num_heads, cfg.num_kv_heads, tp, shard)


def kind_of(name: str) -> Kind:
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")):
        return "col"
    if any(k in name for k in ("o_proj", "down_proj")):
        return "row"
    return "replicated"  # embeddings, norms, q/k norms


def shard_range(name: str, cfg: ModelConfig, tp: int, shard: int) -> ShardRange | None:
    """The slice of the full tensor ``name`` that ``shard`` of ``tp`` holds (None: the whole tensor)."""
    kind = kind_of(name)
    if kind == "replicated" or tp == 1:
        return None
    hd = cfg.head_dim
    dim = 0 if kind == "col" else 1
    if "k_proj" in name or "v_proj" in name:
        lo, hi = kv_head_range(cfg, tp, shard)
        return ShardRange(dim, lo * hd, hi * hd)
    if "q_proj" in name or "o_proj" in name:
        lo, hi = q_head_range(cfg, tp, shard)
        return ShardRange(dim, lo * hd, hi * hd)
    full = cfg.vocab_size if "lm_head" in name else cfg.intermediate_size
    return ShardRange(dim, *head_shards.split(full, tp, shard))


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """How one tensor goes from its old shard to its new one on one rank."""

    name: str
    op: Literal["keep", "slice", "gather"]
    local: ShardRange | None  # for "slice": the range inside the held tensor; for "gather": the new range


def reshard_plan(
    names: list[str], cfg: ModelConfig, old: Layout, new: Layout, rank: int
) -> list[ReshardStep]:
    """Per tensor on ``rank``: keep it, slice the held shard (TP grows), or gather the old group's shards
    (TP shrinks, or uneven shards whose new range is not inside the old one).

    An all-gather is collective: when any rank of this rank's old replica must gather a tensor, all of
    them do (even one that could keep or slice it), so every rank of the group joins the same gathers.
    """
    group = old.ranks_of(old.replica_of(rank))
    plan = []
    for name in names:
        steps = {r: _step(name, cfg, (old.tp, old.shard_of(r)), (new.tp, new.shard_of(r))) for r in group}
        step = steps[rank]
        if step.op != "gather" and any(s.op == "gather" for s in steps.values()):
            step = ReshardStep(name, "gather", shard_range(name, cfg, new.tp, new.shard_of(rank)))
        plan.append(step)
    return plan


def _step(name: str, cfg: ModelConfig, old: tuple[int, int], new: tuple[int, int]) -> ReshardStep:
    """One tensor on one rank, as if it were alone: ``old`` and ``new`` are its (tp, shard)."""
    held = shard_range(name, cfg, *old)
    want = shard_range(name, cfg, *new)
    if held == want:
        return ReshardStep(name, "keep", None)
    if want is not None and (held is None or held.contains(want)):
        base = 0 if held is None else held.start
        return ReshardStep(name, "slice", ShardRange(want.dim, want.start - base, want.stop - base))
    return ReshardStep(name, "gather", want)


def assemble(pieces: list[tuple[ShardRange, object]], full_len: int) -> list[tuple[int, int, int]]:
    """Where each gathered piece goes in the full tensor: (piece index, start, stop), skipping duplicates.

    Pieces of duplicated KV heads hold identical data; the first one covering a range wins.
    """
    out, covered = [], set()
    for i, (rng, _) in enumerate(pieces):
        if (rng.start, rng.stop) in covered:
            continue
        covered.add((rng.start, rng.stop))
        out.append((i, rng.start, rng.stop))
    if sum(stop - start for _, start, stop in out) != full_len:
        raise ValueError(f"gathered shards cover {sorted(covered)}, not [0, {full_len})")
    return out
