"""One rank of the engine: process-group set-up, the lockstep step loop, and results for the parent.

Every rank runs the same loop. Each step, each replica advances (prefill or decode inside its TP group),
then one all-reduce over all ranks yields the global number of unfinished requests; reconfiguration
triggers fire on that number, so every rank decides identically at the same step.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.checkpoint import CheckpointReader, parse_dtype
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.kvcache import KVSlab
from rollout_worker.engine.model import Decoder
from rollout_worker.engine.parallel import ParallelState, gather_sum
from rollout_worker.engine.replica import Replica
from rollout_worker.engine.sequence import Sequence
from rollout_worker.engine.weights import Weights, load_shard, random_shard

Emit = Callable[[str, dict[str, Any]], None]


class RankEngine:
    def __init__(self, rank: int, cfg: EngineConfig, specs: list[RequestSpec], emit: Emit) -> None:
        self.rank, self.cfg, self.emit = rank, cfg, emit
        self.model = ModelConfig.load(cfg.model_dir)
        self.dtype = parse_dtype(cfg.dtype)
        self.device, self.backend, self.stage_cpu = _device_for(rank, cfg)
        self.specs = {s.id: s for s in specs}
        self.capacity = max((s.reserved_tokens for s in specs), default=1)
        self.groups: dict[Layout, list[Any]] = {}
        self.finished: list[Sequence] = []  # finished while this rank was shard 0 of their replica
        self.step_no = 0
        self.migrate_bytes_per_ms = cfg.migrate_bytes_per_ms
        self.layout = cfg.layout
        self.weights: Weights = {}
        self.replica: Replica

    # -- set-up -----------------------------------------------------------------------------------
    def create_groups(self) -> None:
        """Every candidate layout's TP groups, created once, by every rank, in one fixed order."""
        timeout = timedelta(seconds=self.cfg.collective_timeout_s)
        for lay in sorted(self.cfg.candidates, key=lambda x: x.tp):
            if lay.tp == 1:
                self.groups[lay] = [None] * lay.replicas
                continue
            self.groups[lay] = [
                dist.new_group(ranks, timeout=timeout, backend=self.backend) for ranks in lay.groups()
            ]

    def pstate(self, lay: Layout) -> ParallelState:
        return ParallelState(
            tp=lay.tp,
            shard=lay.shard_of(self.rank),
            group=self.groups[lay][lay.replica_of(self.rank)],
            stage_cpu=self.stage_cpu,
        )

    def load(self) -> None:
        lay, shard = self.layout, self.layout.shard_of(self.rank)
        if self.cfg.extra.get("weights") == "random":  # profiling a shape: no checkpoint needed
            self.weights = random_shard(self.model, lay.tp, shard, self.dtype, self.device)
        else:
            reader = CheckpointReader(self.cfg.model_dir, self.model)
            self.weights = load_shard(reader, self.model, lay.tp, shard, self.dtype, self.device)
        self.replica = self.make_replica(lay, self.weights)

    def make_replica(self, lay: Layout, weights: Weights) -> Replica:
        decoder = Decoder(self.model, weights, self.pstate(lay))
        slab = KVSlab(
            self.model.num_layers,
            self.cfg.max_batch,
            self.model.kv_heads_per_rank(lay.tp),
            self.capacity,
            self.model.head_dim,
            self.dtype,
            self.device,
        )
        is_leader = lay.shard_of(self.rank) == 0
        return Replica(
            decoder,
            slab,
            self.cfg.max_batch,
            self.cfg.kv_budget_tokens,
            self.cfg.max_prefill_tokens,
            self.model.eos_token_ids,
            self.finished.append if is_leader else (lambda s: None),
        )

    def assign_initial(self, specs: list[RequestSpec]) -> None:
        """Request i goes to replica i % D (every rank computes the same assignment)."""
        d = self.layout.replica_of(self.rank)
        for i, spec in enumerate(specs):
            if i % self.layout.replicas == d:
                seq = Sequence(spec=spec, history=[{"layout": str(self.layout), "replica": d, "step": 0}])
                self.replica.waiting.append(seq)

    # -- the loop ---------------------------------------------------------------------------------
    def global_unfinished(self) -> int:
        mine = self.replica.unfinished if self.layout.shard_of(self.rank) == 0 else 0
        t = torch.tensor([mine], dtype=torch.int64, device=self.sync_device)
        if self.backend == "gloo":
            return int(gather_sum(t, None, self.cfg.world).item())
        dist.all_reduce(t)
        return int(t.item())

    @property
    def sync_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def run(self) -> dict[str, Any]:
        from rollout_worker.engine.reconfig import reconfigure

        triggers = sorted(self.cfg.triggers, key=lambda t: -t.unfinished)
        step_ms: list[float] = []
        events: list[dict[str, Any]] = []
        total = len(self.specs)
        window_t0 = time.perf_counter()
        while True:
            self.step_no += 1
            t0 = time.perf_counter()
            kind = self.replica.step()
            unfinished = self.global_unfinished()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if unfinished == 0:
                break
            while triggers and unfinished <= triggers[0].unfinished:
                trig = triggers.pop(0)
                target = Layout.for_tp(self.cfg.world, trig.tp)
                if target != self.layout:
                    ev = reconfigure(
                        self, target, trig.method, reason=f"unfinished {unfinished} <= {trig.unfinished}"
                    )
                    events.append(ev)
                    if self.rank == 0:
                        self.emit("reconfig", ev)
            if self.rank == 0 and self.step_no % self.cfg.log_every == 0:
                window = step_ms[-self.cfg.log_every :]
                self.emit(
                    "progress",
                    {
                        "step": self.step_no,
                        "layout": str(self.layout),
                        "unfinished": unfinished,
                        "finished": total - unfinished,
                        "total": total,
                        "last": kind,
                        "step_ms_median": sorted(window)[len(window) // 2],
                        "elapsed_s": time.perf_counter() - window_t0,
                    },
                )
        return {
            "rank": self.rank,
            "steps": self.step_no,
            "step_ms": step_ms,
            "reconfigs": events,
            "finished": [(s.spec.id, s.output, s.finish, s.history) for s in self.finished],
            "layout": str(self.layout),
        }


def _device_for(rank: int, cfg: EngineConfig) -> tuple[torch.device, str, bool]:
    """(device, backend, stage collectives through CPU). Several ranks may share one GPU over gloo."""
    if cfg.device == "cpu":
        return torch.device("cpu"), "gloo", False
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError("--device cuda: no CUDA device is visible")
    dev = torch.device("cuda", rank % n)
    torch.cuda.set_device(dev)
    if cfg.world <= n:
        return dev, "nccl", False
    return dev, "gloo", True


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphaned ranks)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


def rank_main(
    rank: int,
    cfg: EngineConfig,
    specs: list[RequestSpec],
    init_method: str,
    queue: Any,
    task: Callable[[RankEngine, dict[str, Any]], dict[str, Any]] | None = None,
    task_args: dict[str, Any] | None = None,
) -> None:
    """Process entry point: set up, run ``task`` (default: generate ``specs``), report to ``queue``."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and tears ranks down
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def emit(kind: str, payload: dict[str, Any]) -> None:
        queue.put((kind, rank, payload))

    try:
        timeout = timedelta(seconds=cfg.collective_timeout_s)
        eng = RankEngine(rank, cfg, specs, emit)
        dist.init_process_group(
            eng.backend, init_method=init_method, rank=rank, world_size=cfg.world, timeout=timeout
        )
        eng.create_groups()
        eng.load()
        if task is None:
            eng.assign_initial(specs)
            result = eng.run()
        else:
            result = task(eng, task_args or {})
        dist.barrier()
        queue.put(("done", rank, result))
    except BaseException as exc:
        queue.put(
            ("error", rank, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
