"""The profile format: KV capacity from memory by hand, points beyond it reported as infeasible, and the
JSON round trip with and without a capacity."""

from __future__ import annotations

import dataclasses

import pytest
from rollout_profiler.profile import KVCapacity, Profile
from rollout_profiler.profiling.modelled import LLAMA_31_8B
from rollout_profiler.show import render_table
from rollout_profiler.store.testing import sample_profile
from rollout_worker.errors import UserError


def test_kv_capacity_from_memory_by_hand() -> None:
    cap = KVCapacity.from_memory(
        LLAMA_31_8B, 2, (1, 2, 8, 16), gpu_bytes=80e9, fraction=0.9, weight_bytes=16e9, reserve_bytes=4e9
    )
    # per token a TP-T rank keeps 32 layers x (8 / T, at least 1) KV heads x 128 x 2 (K, V) x 2 bytes
    assert cap.tokens(1) == int((72e9 - 16e9 - 4e9) // 131072)  # 396,728 tokens
    assert cap.tokens(2) == int((72e9 - 8e9 - 4e9) // 65536)
    assert cap.tokens(8) == int((72e9 - 2e9 - 4e9) // 16384)
    assert cap.tokens(16) == int((72e9 - 1e9 - 4e9) // 16384)  # one KV head per rank, duplicated
    assert cap.tokens(4) is None
    assert KVCapacity.from_dict(cap.to_dict()) == cap


def test_point_beyond_capacity_is_reported_infeasible() -> None:
    prof = sample_profile(layouts=((2, 1), (1, 2)), batches=(1, 4, 16), contexts=(128, 1024))
    prof.kv_capacity = KVCapacity({1: 4096, 2: 20_000}, {"rule": "by hand"})
    bad = {(p.tp, p.batch, p.context) for p in prof.infeasible_points()}
    # TP1 holds 4,096 tokens: 4 x 1024 fits exactly, 16 x 1024 and 16 x 128 = 2,048 ... only 16 x 1024 fails
    assert bad == {(1, 16, 1024)}
    assert prof.kv_tokens(1) == 4096 and prof.kv_tokens(4) is None
    text = render_table(prof)
    row = next(
        line.split() for line in text.splitlines() if line.startswith("2x1") and line.split()[1] == "16"
    )
    assert row[3].endswith("!") and not row[2].endswith("!")
    assert "kv capacity: TP1 4,096 tokens per replica, TP2 20,000 tokens per replica" in text
    assert "1 point(s) beyond that capacity" in text
    prof.kv_capacity = None
    assert prof.infeasible_points() == [] and "not in the profile" in render_table(prof)


def test_json_round_trip_with_and_without_capacity() -> None:
    prof = sample_profile()
    old = prof.to_dict()
    assert "kv_capacity" not in old and Profile.from_dict(old).kv_capacity is None
    prof.kv_capacity = KVCapacity({1: 1000, 2: 3000}, {"gpu_bytes": 1.0})
    again = Profile.from_dict(prof.to_dict())
    assert again.kv_capacity == prof.kv_capacity and again.to_dict() == prof.to_dict()
    bad = dataclasses.replace(prof, kv_capacity=KVCapacity({1: 0}))
    with pytest.raises(UserError, match="kv_capacity"):
        bad.validate()
