"""Pure sharding: which slice of each full tensor a (TP size, shard index) holds, and how to go from
one TP size to another. No processes, no I/O: everything here is unit-tested directly.

A shard is a contiguous range along one dimension ("column-parallel": rows of an [out, in] weight;
"row-parallel": columns). KV heads are duplicated when TP exceeds their number: shard ``s`` of ``T``
then holds KV head ``s * KV // T``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollout_worker.api.model_config import ModelConfig

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
    n = cfg.kv_heads_per_rank(tp)
    lo = shard * cfg.num_kv_heads // tp
    return lo, lo + n


def q_head_range(cfg: ModelConfig, tp: int, shard: int) -> tuple[int, int]:
    n = cfg.num_heads // tp
    return shard * n, (shard + 1) * n


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
    step = full // tp
    return ShardRange(dim, shard * step, (shard + 1) * step)


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """How one tensor goes from its old shard to its new one on one rank."""

    name: str
    op: Literal["keep", "slice", "gather"]
    local: ShardRange | None  # for "slice": the range inside the held tensor; for "gather": the new range


def reshard_plan(
    names: list[str], cfg: ModelConfig, old: tuple[int, int], new: tuple[int, int]
) -> list[ReshardStep]:
    """Per tensor: keep it, slice the held shard (TP grows), or gather the old group's shards (TP shrinks).

    ``old`` and ``new`` are (tp, shard) of this rank.
    """
    plan = []
    for name in names:
        held = shard_range(name, cfg, *old)
        want = shard_range(name, cfg, *new)
        if held == want:
            plan.append(ReshardStep(name, "keep", None))
        elif want is not None and (held is None or held.contains(want)):
            base = 0 if held is None else held.start
            plan.append(ReshardStep(name, "slice", ShardRange(want.dim, want.start - base, want.stop - base)))
        else:
            plan.append(ReshardStep(name, "gather", want))
    return plan


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
