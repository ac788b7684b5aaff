"""The CUDA-graph path's pure parts, run on CPU in CI: batch buckets, key spans, padding, and when graphs
are used at all. (Capture and replay themselves are tested on a GPU: tests/worker/engine/test_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.decoder import Decoder
from rollout_worker.engine.model.parallel import SINGLE, ParallelState
from rollout_worker.engine.model.presets import preset_config
from rollout_worker.engine.model.weights import random_shard
from rollout_worker.engine.rank.cuda_graphs import (
    KEY_STEP,
    batch_buckets,
    bucket_for,
    graphs_supported,
    key_span,
    pad_step,
)


def test_buckets_are_sglangs_shape_and_end_at_max_batch() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(3) == (1, 2, 3)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    with pytest.raises(ValueError):
        batch_buckets(0)


@given(st.integers(1, 300), st.data())
def test_bucket_is_the_smallest_that_holds_the_batch(max_batch: int, data: st.DataObject) -> None:
    buckets = batch_buckets(max_batch)
    assert list(buckets) == sorted(set(buckets))
    n = data.draw(st.integers(1, max_batch))
    b = bucket_for(n, buckets)
    assert b >= n and b in buckets
    assert all(x < n for x in buckets if x < b)
    assert b - n < 8  # padding wastes fewer than 8 rows


def test_bucket_refuses_batches_outside_the_buckets() -> None:
    with pytest.raises(ValueError, match="outside"):
        bucket_for(65, batch_buckets(64))
    with pytest.raises(ValueError, match="outside"):
        bucket_for(0, batch_buckets(64))


@given(st.integers(0, 10_000), st.integers(1, 40))
def test_key_span_covers_the_position_within_the_slab(pos: int, extra_steps: int) -> None:
    capacity = (pos // KEY_STEP + extra_steps) * KEY_STEP
    if pos >= capacity:
        return
    span = key_span(pos, capacity)
    assert pos < span <= capacity
    assert span % KEY_STEP == 0 or span == capacity
    assert span - (pos + 1) < KEY_STEP  # never a whole step more than needed


def test_key_span_is_capped_by_the_capacity_and_refuses_positions_past_it() -> None:
    assert key_span(10, 100) == 100
    assert key_span(255, 4096) == 256
    assert key_span(256, 4096) == 512
    with pytest.raises(ValueError, match="capacity"):
        key_span(100, 100)


def test_padding_rows_go_to_position_zero_of_free_slots() -> None:
    p = pad_step([5, 6, 7], [10, 300, 2], batch_buckets(64), 1024)
    assert (p.n, p.bucket, p.span) == (3, 4, 512)
    assert p.tokens == [5, 6, 7, 0] and p.positions == [10, 300, 2, 0]
    with pytest.raises(ValueError):
        pad_step([1, 2], [3], batch_buckets(8), 256)


def _decoder(tp: int) -> Decoder:
    cfg = ModelConfig.from_dict(preset_config("tiny"), where="tiny")
    ps = SINGLE if tp == 1 else ParallelState(tp=tp, shard=0, group=None)
    return Decoder(cfg, random_shard(cfg, tp, 0, torch.float32, torch.device("cpu")), ps)


def test_graphs_only_for_cuda_tp1_replicas() -> None:
    assert "CUDA" in graphs_supported(_decoder(1))
    # (a CUDA decoder with TP 2 is refused for its TP; checked on the GPU machine)
