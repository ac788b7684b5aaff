"""Weight sync from a trainer by torch.distributed (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``): a process group of its own between the trainer (rank 0) and every
engine rank (``rank_offset + r``), made beside the engine's groups without touching them, as SGLang's
``init_custom_process_group`` does (a TCPStore at ``master_address:master_port``, prefixed by the group's
name). The trainer broadcasts full tensors from rank 0 in the announced order, one broadcast each or (SGLang's
``flattened_bucket``) one of their bytes back to back; every rank receives them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rollout_worker.engine.checkpoint import TORCH_DTYPES


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where and how to meet the trainer (the fields of ``POST /init_weights_update_group``)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str


def init_custom_process_group(spec: GroupSpec, rank: int, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Rank ``rank`` of a new group, made as SGLang's ``init_custom_process_group`` makes it (so a trainer
    using SGLang's or slime's copy of it meets these ranks): a ``tcp://`` rendezvous (rank 0 hosts the
    store), the store prefixed by the group's name, and a process group that is not the default one."""
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
        timeout=timeout,
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
