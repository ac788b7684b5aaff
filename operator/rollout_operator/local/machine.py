"""What this machine can run, checked before any rank starts (``rolloutctl serve``, ``generate`` and ``run``):
the device is there (``cuda``: a GPU is visible), and an explicit KV budget fits in memory, counted as the
profiler counts a device's KV capacity (:meth:`~rollout_profiler.profile.KVCapacity.from_memory`): each
rank's share of the memory, less its share of the weights, over the KV bytes it keeps per token, at every
TP size the engine may switch to. Without a budget the pool grows as requests need it, so nothing is
checked. Errors name the engine setting (``device``, ``kv_budget_tokens``); callers name it as their
users wrote it (a flag, a manifest's line)."""

from __future__ import annotations

from collections.abc import Iterable

from rollout_profiler.profile import KVCapacity, ModelShape
from rollout_worker.config.engine_settings import DTYPE_BYTES, EngineSettings
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.errors import UserError
from rollout_worker.machine import gpu_memory, machine_memory

GIB = 1 << 30


def check_machine(
    model: ModelConfig, dtype: str, engine: EngineSettings, ranks: int, tp_sizes: Iterable[int]
) -> None:
    """Refuse an engine of ``ranks`` ranks that this machine cannot run (see the module's docstring)."""
    gpus = gpu_memory() if engine.device == "cuda" else []  # (a UserError naming device without one)
    if engine.kv_budget_tokens is None:
        return
    per_rank, where = rank_memory(gpus, ranks)
    elem = DTYPE_BYTES[dtype]
    capacity = KVCapacity.from_memory(
        ModelShape.of("engine", model),
        elem,
        tuple(sorted(set(tp_sizes))),
        gpu_bytes=per_rank,
        fraction=1.0,
        weight_bytes=model.weight_elements * elem,
        reserve_bytes=0.0,
    )
    tokens = engine.pool_tokens
    for tp, most in sorted(capacity.tokens_per_replica.items()):
        if tokens > most:
            raise UserError(
                f"a pool of {tokens} tokens does not fit: a TP={tp} replica of this model ({dtype}) holds at "
                f"most {most} with {where}",
                "kv_budget_tokens",
            )


def rank_memory(gpus: list[int], ranks: int) -> tuple[float, str]:
    """Bytes of memory one rank may use, on ``gpus`` (each device's memory; none: the CPU), and where they
    come from (in words)."""
    if gpus:
        per_gpu = min(gpus)
        sharing = -(-ranks // len(gpus))
        return per_gpu / sharing, f"{sharing} rank(s) on each GPU of {per_gpu / GIB:.1f} GiB"
    total = machine_memory()
    return total / ranks, f"{ranks} rank(s) sharing this machine's {total / GIB:.1f} GiB"
