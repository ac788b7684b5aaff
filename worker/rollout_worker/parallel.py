"""Explicit parallel state handed to the model: the TP group of this rank's replica, its size and shard.

Nothing in the model reads world size or environment variables: the layout changes at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ParallelState:
    tp: int
    shard: int
    group: Any  # torch.distributed ProcessGroup, None when tp == 1
    stage_cpu: bool = False  # gloo with CUDA tensors: run collectives on CPU copies

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return t
        if self.stage_cpu and t.device.type != "cpu":
            c = t.cpu()
            dist.all_reduce(c, group=self.group)
            return c.to(t.device)
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return t
        src = t.cpu() if self.stage_cpu else t
        parts = [torch.empty_like(src) for _ in range(self.tp)]
        dist.all_gather(parts, src.contiguous(), group=self.group)
        out = torch.cat(parts, dim=dim)
        return out.to(t.device) if self.stage_cpu else out


SINGLE = ParallelState(tp=1, shard=0, group=None)
