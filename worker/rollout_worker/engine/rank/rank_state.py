"""Per-rank engine state, and how it is built. The step loop (:mod:`rollout_worker.engine.rank.step_loop`)
owns one
:class:`RankState` and replaces it wholesale when a reconfiguration or a weight load commits
(:func:`rollout_worker.engine.rank.reconfigure.reconfigure` returns a new state; it never mutates the old
one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.drafting.corpus import corpus_index
from rollout_worker.drafting.suffix_index import DraftIndex
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.kernels.choice import Kernels
from rollout_worker.engine.messages import Faults
from rollout_worker.engine.model.checkpoint import CheckpointReader, parse_dtype
from rollout_worker.engine.model.decoder import Decoder
from rollout_worker.engine.model.kv_cache import KVPool
from rollout_worker.engine.model.parallel import ParallelState
from rollout_worker.engine.model.weights import Weights, load_shard, random_shard
from rollout_worker.engine.rank.cuda_graphs import DecodeGraphs, graphs_supported
from rollout_worker.engine.rank.replica import Limits, Replica
from rollout_worker.engine.rank.speculation import Speculator
from rollout_worker.errors import UserError
from rollout_worker.scheduling.costs import CostModel
from rollout_worker.scheduling.layout import Layout

log = logging.getLogger(__name__)

Groups = dict[Layout, list[Any]]  # layout -> process group of each replica (None for TP 1)


@dataclass(slots=True)
class RankState:
    rank: int
    cfg: EngineConfig
    device: torch.device
    backend: str  # gloo | nccl
    stage_cpu: bool  # gloo collectives on CUDA tensors go through host memory
    groups: Groups
    layout: Layout
    weights: Weights
    replica: Replica
    costs: CostModel
    weights_path: str
    epoch: int = 0  # committed reconfigurations
    step: int = 0
    paused: bool = False
    faults: Faults | None = field(default=None, repr=False)
    corpus: DraftIndex = field(default_factory=corpus_index)  # speculation's external corpus

    @property
    def model(self) -> ModelConfig:
        return self.cfg.model

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.cfg.dtype)

    @property
    def replica_index(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def is_leader(self) -> bool:
        """Shard 0 of its replica: the rank that reports the replica's progress."""
        return self.layout.shard_of(self.rank) == 0

    @property
    def sync_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def group_sync(self, count: int, faulted: int = 0, cost: int = 0) -> tuple[int, int, int]:
        """The leader's ``count``, ``faulted`` and ``cost`` to every rank of this replica's TP group (one
        small broadcast): how the serving loop agrees, each step, on how many inbox commands to apply,
        checks that its ranks aborted the same requests for their own failures (``faulted``: a digest of
        them), and shares the leader's pass cost ratio (speculation's ``auto`` policy decides from it)."""
        t = torch.tensor([count, faulted, cost], dtype=torch.int64, device=self.sync_device)
        leader = self.layout.ranks_of(self.replica_index)[0]
        dist.broadcast(t, src=leader, group=self.groups[self.layout][self.replica_index])
        got = t.tolist()
        return int(got[0]), int(got[1]), int(got[2])

    def pstate(self, lay: Layout) -> ParallelState:
        return parallel_state(self.rank, lay, self.groups, self.stage_cpu)

    def decoder(self, weights: Weights, lay: Layout) -> Decoder:
        """This rank's decoder of ``weights`` at ``lay``."""
        return make_decoder(self.cfg, weights, self.pstate(lay))

    def make_replica(self, lay: Layout, weights: Weights) -> Replica:
        """This rank's replica of ``weights`` at ``lay``."""
        rep = make_replica(
            self.cfg, self.rank, lay, weights, self.groups, self.device, self.stage_cpu, self.corpus
        )
        rep.poison = self.faults.poison(self.rank) if self.faults is not None else None
        return rep

    def fault(self, phase: str) -> None:
        if self.faults is not None:
            self.faults.check(phase, self.rank)


def require_cuda(field: str = "device") -> int:
    """The number of CUDA devices visible; UserError naming ``field`` when there is none (checked before
    any rank starts, and by each rank)."""
    n = torch.cuda.device_count()
    if n == 0:
        raise UserError("cuda: no CUDA device is visible (use cpu)", field)
    return n


def device_for(rank: int, cfg: EngineConfig) -> tuple[torch.device, str, bool]:
    """(device, backend, stage collectives through CPU). Several ranks may share one GPU over gloo."""
    if cfg.engine.device == "cpu":
        return torch.device("cpu"), "gloo", False
    n = require_cuda()
    dev = torch.device("cuda", rank % n)
    torch.cuda.set_device(dev)
    if cfg.world <= n:
        return dev, "nccl", False
    return dev, "gloo", True


def create_groups(cfg: EngineConfig, backend: str) -> Groups:
    """Every candidate layout's TP groups, created once, by every rank, in one fixed order."""
    timeout = timedelta(seconds=cfg.engine.collective_timeout_seconds)
    groups: Groups = {}
    for lay in sorted(cfg.candidates, key=lambda x: x.tp):
        if lay.tp == 1:
            groups[lay] = [None] * lay.replicas
        else:
            groups[lay] = [dist.new_group(r, timeout=timeout, backend=backend) for r in lay.groups()]
    return groups


def parallel_state(rank: int, lay: Layout, groups: Groups, stage_cpu: bool) -> ParallelState:
    return ParallelState(
        tp=lay.tp, shard=lay.shard_of(rank), group=groups[lay][lay.replica_of(rank)], stage_cpu=stage_cpu
    )


def make_decoder(cfg: EngineConfig, weights: Weights, ps: ParallelState) -> Decoder:
    """The decoder of ``weights`` on ``ps``, on the kernels the settings choose for the weights' dtype and
    device (the deterministic ones, packed weights)."""
    embed = weights["model.embed_tokens.weight"]
    kernels = Kernels.choose(cfg.engine, cfg.model, embed.dtype, embed.device, cfg.world)
    return Decoder(cfg.model, weights, ps, kernels)


def make_replica(
    cfg: EngineConfig,
    rank: int,
    lay: Layout,
    weights: Weights,
    groups: Groups,
    device: torch.device,
    stage_cpu: bool,
    corpus: DraftIndex,
) -> Replica:
    m = cfg.model
    decoder = make_decoder(cfg, weights, parallel_state(rank, lay, groups, stage_cpu))
    eng = cfg.engine
    pool = KVPool(
        m.num_layers,
        decoder.kv_heads,  # this shard's KV heads (uneven shards differ)
        m.head_dim,
        eng.page_size,
        eng.pool_pages,
        eng.max_batch,
        eng.context_length + 1,
        parse_dtype(cfg.dtype),
        device,
        eng.prefix_cache,
    )
    limits = Limits(eng.max_batch, eng.max_prefill_tokens)
    graphs = None
    if cfg.engine.cuda_graphs:
        why = graphs_supported(decoder)
        if why:
            if device.type == "cuda":
                log.info("rank %d, layout %s: decode steps run eagerly: %s", rank, lay, why)
        else:
            graphs = DecodeGraphs(cfg.engine.max_batch)
    spec = (
        Speculator(eng.speculative_num_draft_tokens, auto=eng.speculative_policy == "auto", corpus=corpus)
        if eng.speculative_algorithm == "ngram"
        else None
    )
    return Replica(decoder, pool, limits, m.eos_token_ids, graphs, speculator=spec)


def load_weights(cfg: EngineConfig, path: str, lay: Layout, rank: int, device: torch.device) -> Weights:
    shard, dtype = lay.shard_of(rank), parse_dtype(cfg.dtype)
    if cfg.random_weights:  # profiling a shape: no checkpoint needed
        return random_shard(cfg.model, lay.tp, shard, dtype, device)
    reader = CheckpointReader(path, cfg.model)
    return load_shard(reader, cfg.model, lay.tp, shard, dtype, device)


def build_state(rank: int, cfg: EngineConfig, faults: Faults | None = None) -> RankState:
    """Groups, this rank's shard of the weights and an empty replica (the process group is initialised)."""
    device, backend, stage_cpu = device_for(rank, cfg)
    groups = create_groups(cfg, backend)
    weights = load_weights(cfg, cfg.model_dir, cfg.layout, rank, device)
    corpus = corpus_index()
    replica = make_replica(cfg, rank, cfg.layout, weights, groups, device, stage_cpu, corpus)
    replica.poison = faults.poison(rank) if faults is not None else None
    return RankState(
        rank=rank,
        cfg=cfg,
        device=device,
        backend=backend,
        stage_cpu=stage_cpu,
        groups=groups,
        layout=cfg.layout,
        weights=weights,
        replica=replica,
        costs=cfg.costs,
        weights_path=cfg.model_dir,
        faults=faults,
        corpus=corpus,
    )
