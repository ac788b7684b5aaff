"""The fixed chunks of the deterministic kernels' row-parallel products, and how the shards add them.

A row-parallel product (attention output, MLP down) sums over K, which TP splits across ranks. Its K is cut
into equal chunks that no layout the model may run at splits (:func:`chunk_bounds`, :class:`RowChunks`):
the same chunks on every layout. Each chunk's partial product is computed alone
(:mod:`~rollout_worker.engine.kernels.row_parallel`); each shard adds its chunks' whole subtrees of one
fixed tree (:func:`shard_sums`), the ranks all-gather those sums and each adds them up the same tree
(:func:`gathered_sum`): one order on every layout, instead of an all-reduce whose order the backend and
the TP size choose.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels.tree_sums import Node, node_sums, tree_nodes, tree_root
from rollout_worker.scheduling import head_shards

TP_SIZES = (1, 2, 4, 8)  # chunk bounds cover these TP sizes (and every divisor of the engine's ranks)


def chunk_bounds(
    shard_bounds: Callable[[int], Iterable[tuple[int, int]]], tps: Iterable[int]
) -> tuple[int, ...]:
    """Equal chunks that no layout splits: multiples of the greatest common divisor of every shard's bounds
    at every TP size in ``tps`` (``shard_bounds(tp)``: the [lo, hi) of each shard of ``tp``). Equal widths
    make a shard's partial products one batched product."""
    cuts: set[int] = set()
    for tp in tps:
        for lo, hi in shard_bounds(tp):
            cuts.update((lo, hi))
    width = math.gcd(*cuts)
    return tuple(range(0, max(cuts) + 1, width))


@dataclass(frozen=True, slots=True)
class Chunks:
    """The fixed K chunks of one row-parallel product, as one shard sees them: their width, and how many
    every shard holds (its own: ``per_shard[shard]``; all: to pick the gathered partials in order)."""

    width: int
    per_shard: tuple[int, ...]
    shard: int

    @property
    def local(self) -> int:
        return self.per_shard[self.shard]

    @property
    def start(self) -> int:
        return self.first(self.shard)

    def first(self, shard: int) -> int:
        """The index, among every shard's, of ``shard``'s first chunk."""
        return sum(self.per_shard[:shard])

    @property
    def total(self) -> int:
        return sum(self.per_shard)

    def nodes(self, shard: int) -> tuple[Node, ...]:
        """``shard``'s chunks as the fewest whole subtrees of the fixed tree over every chunk
        (:func:`~rollout_worker.engine.kernels.tree_sums.tree_nodes`): what it adds before the all-gather."""
        lo = self.first(shard)
        return tree_nodes(lo, lo + self.per_shard[shard], self.total)

    @classmethod
    def of(cls, bounds: tuple[int, ...], shards: list[tuple[int, int]], shard: int) -> Chunks:
        width = bounds[1] - bounds[0]
        for lo, hi in shards:
            if lo % width or hi % width:
                raise ValueError(f"shard [{lo}, {hi}) splits a chunk of {width}")
        return cls(width, tuple((hi - lo) // width for lo, hi in shards), shard)


@dataclass(frozen=True, slots=True)
class RowChunks:
    """The chunk bounds of a model's two row-parallel products on an engine of ``world`` ranks: every shard
    bound of every TP size in ``TP_SIZES`` or dividing ``world`` that the model can run at."""

    attn_out: tuple[int, ...]  # in o_proj's input columns (query heads x head_dim)
    mlp_down: tuple[int, ...]  # in down_proj's input columns (the intermediate size)

    @classmethod
    def of(cls, cfg: ModelConfig, world: int) -> RowChunks:
        sizes = set(TP_SIZES) | {d for d in range(1, world + 1) if world % d == 0}
        tps = [t for t in sorted(sizes) if cfg.tp_problem(t) is None]
        return cls(
            chunk_bounds(lambda tp: attn_shards(cfg, tp), tps),
            chunk_bounds(lambda tp: mlp_shards(cfg, tp), tps),
        )


def attn_shards(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """Each shard's columns of o_proj's input at ``tp`` (its query heads)."""
    hd = cfg.head_dim
    return [
        (lo * hd, hi * hd)
        for lo, hi in (head_shards.q_head_range(cfg.num_heads, cfg.num_kv_heads, tp, s) for s in range(tp))
    ]


def mlp_shards(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """Each shard's columns of down_proj's input at ``tp``."""
    return [head_shards.split(cfg.intermediate_size, tp, s) for s in range(tp)]


def shard_sums(parts: torch.Tensor, chunks: Chunks) -> torch.Tensor:
    """What a shard all-gathers: its partials ``parts`` [local, ...] added into its subtrees
    (:meth:`Chunks.nodes`), zeros appended up to the most subtrees any shard has."""
    sums = node_sums(parts, chunks.start, chunks.total, chunks.nodes(chunks.shard))
    most = max(len(chunks.nodes(s)) for s in range(len(chunks.per_shard)))
    if sums.shape[0] < most:
        sums = torch.cat((sums, sums.new_zeros(most - sums.shape[0], *sums.shape[1:])))
    return sums


def gathered_sum(everyone: list[torch.Tensor], chunks: Chunks) -> torch.Tensor:
    """:func:`~rollout_worker.engine.kernels.tree_sums.tree_sum` of every chunk from each shard's
    :func:`shard_sums` (``everyone``, in shard order)."""
    known = {node: sums[i] for s, sums in enumerate(everyone) for i, node in enumerate(chunks.nodes(s))}
    return tree_root(known, chunks.total)
