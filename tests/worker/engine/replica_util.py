"""An in-process TP-1 replica (no rank processes): the scheduler and the paged pool, step by step."""

from __future__ import annotations

from pathlib import Path

import torch
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels.choice import Kernels
from rollout_worker.engine.model.checkpoint import CheckpointReader
from rollout_worker.engine.model.decoder import Decoder
from rollout_worker.engine.model.kv_cache import KVPool
from rollout_worker.engine.model.parallel import SINGLE
from rollout_worker.engine.model.weights import load_shard
from rollout_worker.engine.rank.replica import Limits, Replica
from rollout_worker.scheduling.admission import SGLANG_RATIO, RatioPolicy


def replica(
    model_dir: Path,
    pages: int,
    page_size: int,
    ratio: RatioPolicy = SGLANG_RATIO,
    max_batch: int = 8,
    prefix_cache: bool = True,
    dtype: torch.dtype = torch.float64,
    deterministic: bool = False,
    pack: bool = True,
) -> Replica:
    cfg = ModelConfig.load(model_dir)
    cpu = torch.device("cpu")
    w = load_shard(CheckpointReader(model_dir, cfg), cfg, 1, 0, dtype, cpu)
    dec = Decoder(cfg, w, SINGLE, Kernels.of(cfg, dtype, cpu, deterministic=deterministic, pack=pack))
    pool = KVPool(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        page_size,
        pages,
        max_batch,
        256,
        dtype,
        cpu,
        prefix_cache,
    )
    return Replica(dec, pool, Limits(max_batch, 8192), cfg.eos_token_ids, None, ratio)
