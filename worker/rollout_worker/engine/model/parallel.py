"""Explicit parallel state handed to the model: the TP group of this rank's replica, its size and shard.

Nothing in the model reads world size or environment variables: the layout changes at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SMALL = 1 << 16  # elements: below this an all-reduce is an all-gather plus a local sum


def gather_sum(t: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Sum over ranks by all-gather + a local sum in rank order.

    On gloo a small all-gather costs about a third of an all-reduce (one round instead of a
    reduce-scatter and an all-gather), and summing in a fixed order gives bit-identical results
    on every rank.
    """
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


@dataclass(frozen=True, slots=True)
class ParallelState:
    tp: int
    shard: int
    group: Any  # torch.distributed ProcessGroup, None when tp == 1
    stage_cpu: bool = False  # gloo with CUDA tensors: run collectives on CPU copies

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return t
        src = t.cpu() if self.stage_cpu else t
        if src.device.type == "cpu" and src.numel() <= SMALL:
            out = gather_sum(src, self.group, self.tp)
        else:
            dist.all_reduce(src, group=self.group)
            out = src
        return out.to(t.device) if self.stage_cpu else out

    def all_gather_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return t
        src = t.cpu() if self.stage_cpu else t
        parts = [torch.empty_like(src) for _ in range(self.tp)]
        dist.all_gather(parts, src.contiguous(), group=self.group)
        out = torch.cat(parts, dim=dim)
        return out.to(t.device) if self.stage_cpu else out


SINGLE = ParallelState(tp=1, shard=0, group=None)
