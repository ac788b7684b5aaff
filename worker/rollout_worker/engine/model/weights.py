"""Loading one rank's shard of every tensor, and resharding it in place when the TP size changes."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.checkpoint import CheckpointReader, random_tensor
from rollout_worker.engine.model.checkpoint_index import tensor_shapes
from rollout_worker.engine.model.parallel import ParallelState
from rollout_worker.engine.model.sharding import ReshardStep, assemble, reshard_plan, shard_range
from rollout_worker.scheduling.layout import Layout

Weights = dict[str, torch.Tensor]


def load_shard(
    reader: CheckpointReader, cfg: ModelConfig, tp: int, shard: int, dtype: torch.dtype, device: torch.device
) -> Weights:
    """Read only this shard's slices from the checkpoint. Tied embeddings share the embedding rows."""
    out: Weights = {}
    for name, _ in tensor_shapes(cfg):
        out[name] = reader.read(name, shard_range(name, cfg, tp, shard), dtype).to(device)
    _tie(out, cfg, tp, shard)
    return out


def random_shard(cfg: ModelConfig, tp: int, shard: int, dtype: torch.dtype, device: torch.device) -> Weights:
    """Seeded random tensors of this shard's shapes, made on the device (latency depends on shape only)."""
    gen = torch.Generator(device=device).manual_seed(shard)
    out: Weights = {}
    for name, shape in tensor_shapes(cfg):
        rng = shard_range(name, cfg, tp, shard)
        if rng is not None:
            shape = tuple(rng.size if d == rng.dim else n for d, n in enumerate(shape))
        out[name] = random_tensor(name, shape, gen, dtype)
    _tie(out, cfg, tp, shard)
    return out


def _tie(weights: Weights, cfg: ModelConfig, tp: int, shard: int) -> None:
    """Tied embeddings: the vocab-parallel lm_head is a view of this shard's rows of the embedding."""
    if cfg.tie_word_embeddings:
        rng = shard_range("lm_head.weight", cfg, tp, shard)
        emb = weights["model.embed_tokens.weight"]
        weights["lm_head.weight"] = emb if rng is None else emb[rng.start : rng.stop]


def reshard(
    weights: Weights, cfg: ModelConfig, old: ParallelState, layouts: tuple[Layout, Layout], rank: int
) -> tuple[Weights, dict[str, int]]:
    """This rank's new shards when the layout switches ``layouts = (old, new)``, leaving ``weights``
    untouched (so a failure can roll back). ``old`` is this rank's parallel state in the old layout.

    Growing TP slices the held shard (no communication). Shrinking all-gathers each tensor inside the
    *old* TP group, whose members hold every piece this rank now needs, then slices (so does growing
    when uneven head shards put a new shard outside the old one).
    Returns the new weights and counters: tensors sliced/gathered and bytes received.
    """
    names = [n for n, _ in tensor_shapes(cfg)]
    src, dst = layouts
    plan = reshard_plan(names, cfg, src, dst, rank)
    new_tp, new_shard = dst.tp, dst.shard_of(rank)
    out: Weights = {}
    stats = {"sliced": 0, "gathered": 0, "bytes_received": 0}
    for step in plan:
        held = weights[step.name]
        if step.op == "keep":
            out[step.name] = held
        elif step.op == "slice":
            assert step.local is not None
            out[step.name] = _slice(held, step)
            stats["sliced"] += 1
        else:
            out[step.name], received = _gather(held, step, cfg, old)
            stats["gathered"] += 1
            stats["bytes_received"] += received
    _tie(out, cfg, new_tp, new_shard)
    return out, stats


def _slice(held: torch.Tensor, step: ReshardStep) -> torch.Tensor:
    """Rows of the held shard are a zero-copy view (in place: no memory traffic, nothing allocated);
    columns are copied once so that every later step multiplies a contiguous matrix."""
    assert step.local is not None
    lo, hi = step.local.start, step.local.stop
    if step.local.dim == 0:
        return held[lo:hi]
    return held[:, lo:hi].contiguous()


def _gather(
    held: torch.Tensor, step: ReshardStep, cfg: ModelConfig, old: ParallelState
) -> tuple[torch.Tensor, int]:
    """All-gather the old group's shards of one tensor, rebuild the full tensor, cut the new range.

    Uneven shards (head counts that do not divide TP) travel zero-padded to the widest one (an
    all-gather moves equal sizes) and are cut back to their own width. Returns the tensor and the
    bytes received from the other ranks.
    """
    # only sharded tensors are gathered (old TP > 1): one range per old shard
    ranges = [r for r in (shard_range(step.name, cfg, old.tp, s) for s in range(old.tp)) if r is not None]
    dim, width = ranges[0].dim, max(r.size for r in ranges)
    src = held.cpu() if old.stage_cpu else held
    if src.shape[dim] < width:  # F.pad lists (before, after) pairs from the last dimension back
        src = F.pad(src, [0, 0] * (src.dim() - 1 - dim) + [0, width - src.shape[dim]])
    parts = [torch.empty_like(src) for _ in range(old.tp)]
    dist.all_gather(parts, src.contiguous(), group=old.group)
    pieces = [(r, p.narrow(dim, 0, r.size)) for r, p in zip(ranges, parts, strict=True)]
    order = assemble(pieces, _full_len(step.name, cfg, dim))  # type: ignore[arg-type]
    full = torch.cat([pieces[i][1] for i, _, _ in order], dim=dim)
    received = src.numel() * src.element_size() * (old.tp - 1)
    if step.local is None:
        return full.to(held.device), received
    lo, hi = step.local.start, step.local.stop
    part = full[lo:hi] if dim == 0 else full[:, lo:hi]
    return part.contiguous().to(held.device), received


def _full_len(name: str, cfg: ModelConfig, dim: int) -> int:
    return dict(tensor_shapes(cfg))[name][dim]
