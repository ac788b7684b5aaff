"""Decode steps replayed from CUDA graphs.

A decode step of a 32-layer model launches several hundred small kernels; eagerly, the host's launch time
is a large part of the step at small batches. A CUDA graph records one step's kernels once and replays them
with a single launch. A graph is captured for fixed shapes and fixed memory addresses, so:

- the batch is padded up to a *batch bucket* (1, 2, 4, 8, then every 8, as SGLang's defaults), its rows
  writing and reading the KV pool's null page at position 0 (token-table rows ``B..bucket-1`` hold no
  running request, so they are all null);
- the step attends over a *key span* (positions ``[:span]`` of each row of the pool's token table, a
  multiple of ``KEY_STEP``), gathered inside the graph from the table (the replica updates the table in
  place before each replay), with a mask built inside the graph from the positions, so a graph serves
  every step until a request passes the span;
- inputs (tokens, positions, K/V write slots) go through static buffers, and the graph's output is read
  back after replay;
- graphs are keyed by (bucket, span) and dropped whenever the decoder's weights or the pool's tensors
  change (a reconfiguration, a weight load, a released or grown pool or token table): a stale graph would
  read freed memory.

Capture is lazy (the first step of a shape captures it, after two eager warm-up steps on the same inputs:
writing a token's K/V at its position twice is idempotent) and all graphs share one memory pool.
Replaying a graph computes exactly what :meth:`Decoder.forward` computes on the same padded inputs.

The bucketing functions are pure and have no CUDA dependency (tested on CPU).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout_worker.engine.model.decoder import Decoder
from rollout_worker.engine.model.kv_cache import KVPool
from rollout_worker.scheduling.pages import round_up

log = logging.getLogger(__name__)

KEY_STEP = 256  # key spans are multiples of this (the token table's own growth step)
MAX_GRAPHS = 96  # past this many captured shapes, drop them all and start again (bounded memory)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every 8, and ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return (*sizes, max_batch)


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``batch`` rows."""
    if batch < 1 or batch > buckets[-1]:
        raise ValueError(f"batch {batch} outside 1..{buckets[-1]}")
    return buckets[bisect_left(buckets, batch)]


def key_span(max_position: int, capacity: int, step: int = KEY_STEP) -> int:
    """Keys a step attends over: position ``max_position`` included, rounded up to ``step``, at most the
    token table's ``capacity`` (which already holds ``max_position``)."""
    if max_position >= capacity:
        raise ValueError(f"position {max_position} is past the token table's capacity {capacity}")
    return min(round_up(max_position + 1, step), capacity)


@dataclass(frozen=True, slots=True)
class Padded:
    """One decode step's inputs padded to a bucket: rows ``n..bucket-1`` are padding."""

    n: int
    bucket: int
    span: int
    tokens: list[int]
    positions: list[int]
    write: list[int]


def pad_step(
    tokens: Sequence[int],
    positions: Sequence[int],
    buckets: Sequence[int],
    capacity: int,
    write: Sequence[int] | None = None,
) -> Padded:
    """Pad a decode step of ``len(tokens)`` rows to its bucket (padding: token 0 at position 0, its K/V
    written to slot 0, the null page). ``write``: the rows' K/V slots (default: the null slot)."""
    n = len(tokens)
    if n != len(positions):
        raise ValueError(f"{n} tokens but {len(positions)} positions")
    slots = list(write) if write is not None else [0] * n
    bucket = bucket_for(n, buckets)
    span = key_span(max(positions), capacity)
    pad = [0] * (bucket - n)
    return Padded(n, bucket, span, [*tokens, *pad], [*positions, *pad], [*slots, *pad])


class _Graph:
    """One captured decode step: static inputs, the graph, and its logits output."""

    def __init__(self, tokens: torch.Tensor, positions: torch.Tensor, write: torch.Tensor) -> None:
        self.tokens, self.positions, self.write = tokens, positions, write
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    """The CUDA graphs of one replica's decode step (see the module's docstring)."""

    def __init__(self, max_batch: int) -> None:
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._owner: tuple[int, ...] | None = None  # (decoder, K, V, token table) tensor ids
        self._pool: Any = None  # torch.cuda.graph_pool_handle()
        self.captures = 0  # graphs captured since start (a metric of recapture churn)

    def clear(self) -> None:
        """Drop every graph (their memory pool goes with the last reference)."""
        self._graphs.clear()
        self._owner = None
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def _check_owner(self, decoder: Decoder, pool: KVPool) -> None:
        owner = (id(decoder), id(pool.k[0]), id(pool.v[0]), id(pool.table))
        if owner != self._owner:
            self.clear()
            self._owner = owner

    def decode(
        self,
        decoder: Decoder,
        pool: KVPool,
        tokens: Sequence[int],
        positions: Sequence[int],
        write: Sequence[int],
    ) -> torch.Tensor:
        """Logits [len(tokens), vocab] of one decode step (row b: token ``tokens[b]`` at ``positions[b]``
        of token-table row b, its K/V written at slot ``write[b]``), replayed from a graph (captured on
        first use of its shape)."""
        n = len(tokens)
        bucket = bucket_for(n, self.buckets)
        pool.ensure_table(bucket, max(positions) + 1)  # before the owner check: growing replaces it
        self._check_owner(decoder, pool)
        step = pad_step(tokens, positions, self.buckets, pool.capacity, write)
        key = (step.bucket, step.span)
        g = self._graphs.get(key)
        dev = decoder.embed.device
        if g is None:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.clear()  # same owner: only the captured shapes go
            g = _Graph(*(torch.zeros((step.bucket, 1), dtype=torch.long, device=dev) for _ in range(3)))
            self._fill(g, step)
            self._capture(g, decoder, pool, step)
            self._graphs[key] = g
        else:
            self._fill(g, step)
        g.graph.replay()
        assert g.logits is not None
        return g.logits[:n]

    @staticmethod
    def _fill(g: _Graph, step: Padded) -> None:
        g.tokens.copy_(torch.tensor(step.tokens, dtype=torch.long)[:, None], non_blocking=False)
        g.positions.copy_(torch.tensor(step.positions, dtype=torch.long)[:, None], non_blocking=False)
        g.write.copy_(torch.tensor(step.write, dtype=torch.long)[:, None], non_blocking=False)

    def _capture(self, g: _Graph, decoder: Decoder, pool: KVPool, step: Padded) -> None:
        def run() -> torch.Tensor:
            return decoder.step_logits(g.tokens, g.positions, pool, g.write, step.span)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on the real inputs (idempotent writes), off the graph
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.logits = run()
        self.captures += 1
        log.debug("captured a decode graph: batch bucket %d, key span %d", step.bucket, step.span)


def graphs_supported(decoder: Decoder) -> str:
    """Why this replica's decode step cannot be captured ("" when it can)."""
    if decoder.embed.device.type != "cuda":
        return "not on a CUDA device"
    if decoder.ps.tp > 1:
        # gloo collectives (several ranks on one GPU) go through host memory and cannot be captured; NCCL
        # collectives can, but no machine here has two GPUs to test it, so TP > 1 stays eager for now.
        return f"TP={decoder.ps.tp} (graphs are captured for TP=1 replicas only)"
    return ""
