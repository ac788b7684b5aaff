"""Weight sync from a trainer by torch.distributed (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``): a process group of its own between the trainer (rank 0) and every
engine rank (``rank_offset + r``), made beside the engine's groups without touching them, as SGLang's
``init_custom_process_group`` does (a TCPStore at ``master_address:master_port``, prefixed by the group's
name). The trainer broadcasts full tensors from rank 0 in the announced order; every rank receives them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend  # what a process group's backend is (broadcast, barrier)

from rollout_worker.engine.checkpoint import TORCH_DTYPES


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where and how to meet the trainer (the fields of ``POST /init_weights_update_group``)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str


def init_custom_process_group(spec: GroupSpec, rank: int, timeout_s: float = 300.0) -> Backend:
    """Rank ``rank`` of a new group (rank 0 hosts the store): the trainer and every engine rank call this."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        spec.master_address, spec.master_port, spec.world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = dist.PrefixStore(f"{spec.group_name}/", store)
    if spec.backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)


def receive(
    pg: Backend, names: list[str], dtypes: list[str], shapes: list[list[int]], device: torch.device
) -> dict[str, torch.Tensor]:
    """The full tensors rank 0 broadcasts, in order (dtypes as the server checked them: ``dtype_name``)."""
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=device)
        pg.broadcast(t, 0).wait()  # type: ignore[attr-defined]  # the stubs omit the backend's collectives
        out[name] = t
    return out
