"""Pure sharding functions: ranges, reshard plans, assembling gathered shards."""

from __future__ import annotations

import pytest
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.presets import preset_config
from rollout_worker.engine.model.sharding import (
    ShardRange,
    assemble,
    kind_of,
    kv_head_range,
    q_head_range,
    reshard_plan,
    shard_range,
)
from rollout_worker.scheduling.layout import Layout

CFG = ModelConfig.from_dict(preset_config("tiny"))  # 8 heads, 2 KV heads, head_dim 16, inter 384, vocab 512
SMOL = ModelConfig.from_dict(preset_config("smol-shape"))  # 9 heads, 3 KV heads, head_dim 64, inter 384


def test_kinds() -> None:
    assert kind_of("model.layers.0.self_attn.q_proj.weight") == "col"
    assert kind_of("model.layers.0.self_attn.q_proj.bias") == "col"
    assert kind_of("model.layers.0.mlp.down_proj.weight") == "row"
    assert kind_of("model.layers.0.self_attn.o_proj.weight") == "row"
    assert kind_of("model.embed_tokens.weight") == "replicated"
    assert kind_of("model.layers.0.self_attn.q_norm.weight") == "replicated"
    assert kind_of("lm_head.weight") == "col"


@pytest.mark.parametrize(
    ("cfg", "tp"), [(CFG, 1), (CFG, 2), (CFG, 4), (CFG, 8), (SMOL, 2), (SMOL, 4), (SMOL, 8)]
)
def test_shards_partition_every_tensor(cfg: ModelConfig, tp: int) -> None:
    hd = cfg.head_dim
    for name, full in [
        ("model.layers.0.self_attn.q_proj.weight", cfg.num_heads * hd),
        ("model.layers.0.self_attn.o_proj.weight", cfg.num_heads * hd),
        ("model.layers.0.self_attn.k_proj.weight", cfg.num_kv_heads * hd),
        ("model.layers.0.mlp.up_proj.weight", cfg.intermediate_size),
        ("model.layers.0.mlp.down_proj.weight", cfg.intermediate_size),
        ("lm_head.weight", cfg.vocab_size),
    ]:
        ranges = [shard_range(name, cfg, tp, s) for s in range(tp)]
        if tp == 1:
            assert ranges == [None]
            continue
        assert all(r is not None for r in ranges)
        if "self_attn" in name:  # whole heads
            assert all(r.start % hd == 0 and r.stop % hd == 0 for r in ranges if r)
        # in order; duplicated KV heads (TP above their number) are assembled once
        covered = [i for _, lo, hi in assemble([(r, None) for r in ranges if r], full) for i in range(lo, hi)]
        assert covered == list(range(full)), name


def test_smollm2_heads_shard_unevenly() -> None:
    """9 heads in 3 KV groups: TP 2 gives whole groups (1 and 2), TP 4 splits group 0's heads over two
    ranks that both hold its KV head; the row-parallel o_proj columns follow the query heads."""
    assert [q_head_range(SMOL, 2, s) for s in range(2)] == [(0, 3), (3, 9)]
    assert [kv_head_range(SMOL, 2, s) for s in range(2)] == [(0, 1), (1, 3)]
    assert [q_head_range(SMOL, 4, s) for s in range(4)] == [(0, 1), (1, 3), (3, 6), (6, 9)]
    assert [kv_head_range(SMOL, 4, s) for s in range(4)] == [(0, 1), (0, 1), (1, 2), (2, 3)]
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    assert [shard_range(o_proj, SMOL, 4, s) for s in range(4)] == [
        ShardRange(1, 0, 64), ShardRange(1, 64, 192), ShardRange(1, 192, 384), ShardRange(1, 384, 576)
    ]  # fmt: skip


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


@pytest.mark.parametrize(
    ("cfg", "src", "dst"),
    [
        (CFG, "4x1", "2x2"),
        (CFG, "2x2", "1x4"),
        (CFG, "4x1", "1x4"),
        (CFG, "4x2", "1x8"),
        (SMOL, "2x1", "1x2"),
        (SMOL, "4x1", "2x2"),
        (SMOL, "2x2", "1x4"),
        (SMOL, "4x1", "1x4"),
    ],
)
def test_growing_only_slices_held_shards(cfg: ModelConfig, src: str, dst: str) -> None:
    a, b = Layout.parse(src), Layout.parse(dst)
    names = [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
        "model.norm.weight",
    ]
    for rank in range(a.world):
        plan = reshard_plan(names, cfg, a, b, rank)
        assert {s.op for s in plan} <= {"slice", "keep"}, (rank, plan)
        for step in plan:
            if step.op == "slice":
                held = shard_range(step.name, cfg, a.tp, a.shard_of(rank))
                want = shard_range(step.name, cfg, b.tp, b.shard_of(rank))
                base = 0 if held is None else held.start
                assert want is not None and step.local is not None
                assert (step.local.start + base, step.local.stop + base) == (want.start, want.stop)


def test_shrinking_gathers() -> None:
    names = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    plan = reshard_plan(names, CFG, Layout.parse("1x4"), Layout.parse("2x2"), 1)
    assert [s.op for s in plan] == ["gather", "keep"]
    assert plan[0].local == ShardRange(0, 0, 192)
    to_full = reshard_plan(names[:1], CFG, Layout.parse("1x2"), Layout.parse("2x1"), 1)
    assert to_full[0].op == "gather" and to_full[0].local is None


@pytest.mark.parametrize(("src", "dst"), [("1x4", "2x2"), ("4x2", "1x8")])
def test_a_gather_is_joined_by_the_whole_old_group(src: str, dst: str) -> None:
    """Uneven shards: in 1x4 -> 2x2 ranks 0 and 1 keep their KV head 0 while ranks 2 and 3 (KV heads 1, 2)
    must gather [1, 3); in 4x2 -> 1x8 rank 3's new KV head 1 is not inside its old shard's head 0. The
    all-gather is collective, so every rank of the old replica gathers that tensor (no rank waits alone)."""
    a, b = Layout.parse(src), Layout.parse(dst)
    name = "model.layers.0.self_attn.k_proj.weight"
    gathering = []
    for d in range(a.replicas):
        ops = {r: reshard_plan([name], SMOL, a, b, r)[0] for r in a.ranks_of(d)}
        if any(s.op == "gather" for s in ops.values()):
            gathering.append(d)
            assert all(s.op == "gather" and s.local == shard_range(name, SMOL, b.tp, b.shard_of(r))
                       for r, s in ops.items()), ops  # fmt: skip
    assert gathering == ([0] if src == "1x4" else [3])  # 4x2: replica 3 (ranks 3, 7) alone


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
