"""Pure sharding functions: ranges, reshard plans, assembling gathered shards."""

from __future__ import annotations

import pytest
from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.engine.presets import preset_config
from rollout_worker.engine.sharding import (
    ShardRange,
    assemble,
    kind_of,
    kv_head_range,
    q_head_range,
    reshard_plan,
    shard_range,
)

CFG = ModelConfig.from_dict(preset_config("tiny"))  # 8 heads, 2 KV heads, head_dim 16, inter 384, vocab 512


def test_kinds() -> None:
    assert kind_of("model.layers.0.self_attn.q_proj.weight") == "col"
    assert kind_of("model.layers.0.self_attn.q_proj.bias") == "col"
    assert kind_of("model.layers.0.mlp.down_proj.weight") == "row"
    assert kind_of("model.layers.0.self_attn.o_proj.weight") == "row"
    assert kind_of("model.embed_tokens.weight") == "replicated"
    assert kind_of("model.layers.0.self_attn.q_norm.weight") == "replicated"
    assert kind_of("lm_head.weight") == "col"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shards_partition_every_tensor(tp: int) -> None:
    for name, full in [
        ("model.layers.0.self_attn.q_proj.weight", 128),
        ("model.layers.0.mlp.up_proj.weight", 384),
        ("model.layers.0.mlp.down_proj.weight", 384),
        ("lm_head.weight", 512),
    ]:
        ranges = [shard_range(name, CFG, tp, s) for s in range(tp)]
        if tp == 1:
            assert ranges == [None]
            continue
        assert all(r is not None for r in ranges)
        covered = [i for r in ranges if r for i in range(r.start, r.stop)]
        assert covered == list(range(full)), name


def test_kv_heads_duplicate_beyond_their_number() -> None:
    assert [kv_head_range(CFG, 2, s) for s in range(2)] == [(0, 1), (1, 2)]
    assert [kv_head_range(CFG, 4, s) for s in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(CFG, 8, s) for s in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    # each rank's query heads belong to the KV head it holds (GQA group = 4 query heads)
    for tp in (1, 2, 4, 8):
        for s in range(tp):
            qlo, qhi = q_head_range(CFG, tp, s)
            klo, khi = kv_head_range(CFG, tp, s)
            assert all(klo <= q // 4 < khi for q in range(qlo, qhi))


@pytest.mark.parametrize(("src", "dst"), [("4x1", "2x2"), ("2x2", "1x4"), ("4x1", "1x4"), ("4x2", "1x8")])
def test_growing_only_slices_held_shards(src: str, dst: str) -> None:
    a, b = Layout.parse(src), Layout.parse(dst)
    names = [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
        "model.norm.weight",
    ]
    for rank in range(a.world):
        plan = reshard_plan(names, CFG, (a.tp, a.shard_of(rank)), (b.tp, b.shard_of(rank)))
        assert {s.op for s in plan} <= {"slice", "keep"}, (rank, plan)
        for step in plan:
            if step.op == "slice":
                held = shard_range(step.name, CFG, a.tp, a.shard_of(rank))
                want = shard_range(step.name, CFG, b.tp, b.shard_of(rank))
                base = 0 if held is None else held.start
                assert want is not None and step.local is not None
                assert (step.local.start + base, step.local.stop + base) == (want.start, want.stop)


def test_shrinking_gathers() -> None:
    plan = reshard_plan(["model.layers.0.mlp.up_proj.weight", "model.norm.weight"], CFG, (4, 1), (2, 0))
    assert [s.op for s in plan] == ["gather", "keep"]
    assert plan[0].local == ShardRange(0, 0, 192)
    to_full = reshard_plan(["model.layers.0.mlp.up_proj.weight"], CFG, (2, 1), (1, 0))
    assert to_full[0].op == "gather" and to_full[0].local is None


def test_assemble_skips_duplicate_kv_shards_and_checks_coverage() -> None:
    pieces = [
        (ShardRange(0, 0, 16), "a"),
        (ShardRange(0, 0, 16), "a"),
        (ShardRange(0, 16, 32), "b"),
        (ShardRange(0, 16, 32), "b"),
    ]
    assert assemble(pieces, 32) == [(0, 0, 16), (2, 16, 32)]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cover"):
        assemble(pieces[:2], 32)  # type: ignore[arg-type]
