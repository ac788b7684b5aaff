"""Weight sync from a trainer by torch.distributed (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``): a process group of its own between the trainer (rank 0) and every
engine rank (``rank_offset + r``), made beside the engine's groups without touching them, as SGLang's
``init_custom_process_group`` does (a TCPStore at ``master_address:master_port``, prefixed by the group's
name). The trainer broadcasts full tensors from rank 0 in the announced order, one broadcast each or (SGLang's
``flattened_bucket``) one of their bytes back to back; every rank receives them all.

A join waits for the trainer, so each rank joins in a thread of its own (:class:`TrainerGroups`) and keeps
stepping meanwhile; the driver (``rollout_worker.engine.driver.weight_groups.GroupBook``) uses a group only
once
every rank has joined it, and gives a join up after its timeout.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rollout_worker.engine.messages import Done, JoinWeightGroup
from rollout_worker.engine.model.checkpoint import TORCH_DTYPES

BROADCAST_TIMEOUT_S = 300.0  # a trainer's broadcast of the weights, once the group is made


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where and how to meet the trainer (the fields of ``POST /init_weights_update_group``)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str


def init_custom_process_group(spec: GroupSpec, rank: int, timeout_s: float) -> dist.ProcessGroup:
    """Rank ``rank`` of a new group, made as SGLang's ``init_custom_process_group`` makes it (so a trainer
    using SGLang's or slime's copy of it meets these ranks): a ``tcp://`` rendezvous (rank 0 hosts the
    store), the store prefixed by the group's name, and a process group that is not the default one. The
    rendezvous gives up after ``timeout_s`` (but torch's store client waits without end on a peer that
    accepts the connection and never answers: the caller must not wait on this)."""
    timeout = timedelta(seconds=timeout_s)
    init = f"tcp://{spec.master_address}:{spec.master_port}"
    store, rank, world = next(dist.rendezvous(init, rank, spec.world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        world,
        rank,
        [],
        dist.Backend(spec.backend),
        dist.PrefixStore(spec.group_name, store),
        group_name=c10d.GroupName(spec.group_name),
        timeout=timedelta(seconds=max(timeout_s, BROADCAST_TIMEOUT_S)),
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def receive(
    pg: dist.ProcessGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: torch.device,
    bucket: bool = False,
) -> dict[str, torch.Tensor]:
    """The full tensors rank 0 broadcasts, in order (dtypes as the server checked them: ``dtype_name``)."""
    if bucket:
        return _receive_bucket(pg, names, [TORCH_DTYPES[d] for d in dtypes], shapes, device)
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=device)
        dist.broadcast(t, 0, group=pg)
        out[name] = t
    return out


def _receive_bucket(
    pg: dist.ProcessGroup,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One broadcast of a uint8 buffer holding every tensor's bytes in order, as current SGLang's
    ``FlattenedTensorBucket`` lays them out (its ``_update_bucketed_weights_from_distributed``)."""
    sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(flat, 0, group=pg)
    out, start = {}, 0
    for name, dtype, shape, size in zip(names, dtypes, shapes, sizes, strict=True):
        out[name] = flat[start : start + size].clone().view(dtype).reshape(shape)  # (a copy: aligned)
        start += size
    return out


class TrainerGroups:
    """One rank's groups with trainers, by name. Each join runs in a thread of its own, which answers the
    driver itself (``Done``); a join the driver gave up on (``leave`` came first) is dropped when it ends.
    Thread-safe."""

    def __init__(self, rank: int, send: Callable[[Done], None]) -> None:
        self.rank, self.send = rank, send
        self._lock = threading.Lock()
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._joining: dict[str, int] = {}  # group name -> the ticket of its join under way

    def join(self, cmd: JoinWeightGroup) -> None:
        """Start joining (returns at once)."""
        with self._lock:
            self._joining[cmd.group_name] = cmd.ticket
        name = f"join-{cmd.group_name}"
        threading.Thread(target=self._join, args=(cmd,), name=name, daemon=True).start()

    def _join(self, cmd: JoinWeightGroup) -> None:
        spec = GroupSpec(cmd.master_address, cmd.master_port, cmd.world_size, cmd.group_name, cmd.backend)
        try:
            pg: dist.ProcessGroup | None = init_custom_process_group(
                spec, cmd.rank_offset + self.rank, cmd.timeout_s
            )
            error = ""
        except Exception as exc:  # torch's messages run on with a C++ backtrace: the first line says it
            pg, error = None, f"rank {self.rank}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        with self._lock:
            wanted = self._joining.get(cmd.group_name) == cmd.ticket
            if wanted:
                del self._joining[cmd.group_name]
                if pg is not None:
                    self._groups[cmd.group_name] = pg
        if pg is not None and not wanted:
            dist.destroy_process_group(pg)
        ok = pg is not None and wanted
        self.send(Done(cmd.ticket, self.rank, ok, error or ("" if ok else "given up")))

    def leave(self, name: str) -> None:
        """Leave the group (a join under way is given up)."""
        with self._lock:
            self._joining.pop(name, None)
            pg = self._groups.pop(name, None)
        if pg is not None:
            dist.destroy_process_group(pg)

    def __getitem__(self, name: str) -> dist.ProcessGroup:
        with self._lock:
            return self._groups[name]
