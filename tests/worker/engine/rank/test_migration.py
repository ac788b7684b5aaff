"""Pure reconfiguration planning: placement, KV migration plan, cost model."""

from __future__ import annotations

from collections import Counter

import pytest
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.presets import preset_config
from rollout_worker.engine.model.sharding import kv_head_range
from rollout_worker.engine.rank.migration import (
    Placement,
    Shared,
    Unfinished,
    kv_migration_plan,
    migrate_bytes,
    migrate_pages,
    place,
    recompute_tokens,
    shared_pages,
)
from rollout_worker.scheduling.admission import Req, admit
from rollout_worker.scheduling.costs import CostModel, estimated_moved_bytes
from rollout_worker.scheduling.layout import Layout

CFG = ModelConfig.from_dict(preset_config("tiny"))
SMOL = ModelConfig.from_dict(preset_config("smol-shape"))  # 3 KV heads: uneven at every TP size above 1


ROOMY = 10_000  # pages of a pool that holds everything


def _reqs(n: int, replicas: int) -> list[Unfinished]:
    """Running requests: KV length 10 + i (prompt 10 + i, one token generated), 5 (i + 1) tokens to go."""
    return [
        Unfinished(f"r{i}", i % replicas, i // replicas, Req(10 + i, 1, 5 * (i + 1) + 1)) for i in range(n)
    ]


def test_place_balances_remaining_work() -> None:
    reqs = _reqs(8, 4)
    placed = place(reqs, 2, 8, ROOMY, 1, 0.7)
    load = Counter()
    for p in placed:
        load[p.dst_replica] += next(r.remaining for r in reqs if r.id == p.id)
    assert abs(load[0] - load[1]) <= 5  # LPT on 5..40: within the smallest item
    assert sorted(p.id for p in placed) == sorted(r.id for r in reqs)
    for d in (0, 1):
        slots = sorted(p.dst_slot for p in placed if p.dst_replica == d and p.dst_slot is not None)
        assert slots == list(range(len(slots)))


def test_place_overflow_waits() -> None:
    placed = place(_reqs(8, 4), 1, 3, ROOMY, 1, 0.7)
    assert sum(p.dst_slot is not None for p in placed) == 3
    waiting = [Unfinished("w", 0, None, Req(4, 0, 8))]  # a waiting request keeps waiting, room or not
    assert [p.dst_slot for p in place(waiting, 1, 8, ROOMY, 1, 0.7)] == [None]


def _same() -> list[Unfinished]:
    """Four running requests of KV length 10, 40 tokens to go: prompt + max_new_tokens = 51 each."""
    return [Unfinished(f"r{i}", 0, i, Req(10, 1, 41)) for i in range(4)]


@pytest.mark.parametrize(("ratio", "running"), [(0.5, 3), (1.0, 2)])
def test_place_admits_optimistically_as_the_replica_does(ratio: float, running: int) -> None:
    """A pool of 120 one-token pages: reserving prompt + max_new_tokens (51 each) would keep 2 running. By
    the admission rule, each candidate costs its 10 cached tokens + its 40 to go + a page of slack = 51,
    against the free tokens less the kept requests' 40 x ratio each. Ratio 0.5: r0 (alone, 11 pages for
    its next step), r1 (51 < 110 - 20), r2 (51 < 100 - 40), not r3 (51 >= 90 - 60): 3 running. Ratio 1:
    r0, r1 (51 < 110 - 40), not r2 (51 >= 100 - 80): 2. The kept ones are exactly those :func:`admit`
    takes one at a time (one home for the rule)."""
    placed = place(_same(), 1, 64, 120, 1, ratio)
    assert [p.dst_slot for p in placed] == [*range(running), *[None] * (4 - running)]
    kept: list[Req] = []
    for u in _same():
        if admit(kept, [u.req], 120 - sum(r.pages for r in kept), 1, ratio, 64, 1):
            kept.append(Req(u.req.prompt, 1, 41, pages=10))
    assert len(kept) == running


def test_place_counts_whole_pages() -> None:
    """Pages of 16 tokens, 10 pages (160 tokens), ratio 0.5: a candidate costs its whole page (10 tokens
    cached) + 40 + a page of slack = 72 tokens; each kept one holds 1 page. r0 alone; r1: 72 < 9 x 16 -
    20; r2: 72 < 8 x 16 - 40; r3: 72 >= 7 x 16 - 60 waits. A pool of one page runs the first alone (its
    next step, 11 tokens, fits in the page) and nothing beside it."""
    assert [p.dst_slot for p in place(_same(), 1, 64, 10, 16, 0.5)] == [0, 1, 2, None]
    assert [p.dst_slot for p in place(_same(), 1, 64, 1, 16, 0.5)] == [0, None, None, None]


def test_shared_pages_move_once_and_stay_shared() -> None:
    """Three samples of one prompt on old replica 0 (pages 1-3 shared, 12 tokens in pages of 4), one
    request on replica 1 whose table also starts with page 1 (another replica's page 1: not shared), all
    consolidated onto one replica: the later samples skip the pages they share with the first."""
    reqs = [
        Unfinished("a", 0, 0, Req(14, 1, 21), (1, 2, 3, 4)),  # 14 tokens cached: 4 pages
        Unfinished("b", 0, 1, Req(15, 1, 21), (1, 2, 3, 5)),
        Unfinished("c", 0, 2, Req(13, 1, 21), (1, 2, 6, 7)),  # shares 2 pages with a and b
        Unfinished("d", 1, 0, Req(14, 1, 21), (1, 2, 3, 4)),
    ]
    placed = place(reqs, 1, 8, ROOMY, 4, 0.7)
    assert all(p.dst_slot is not None for p in placed)
    shared = shared_pages(reqs, placed)
    assert shared == {"b": Shared("a", 3), "c": Shared("a", 2)}
    old, new = Layout.parse("2x1"), Layout.parse("1x2")
    plan = kv_migration_plan(CFG, old, new, placed, 4, shared)
    skips = {t.id: (t.skip, t.pages) for t in plan}
    assert skips == {"a": (0, 4), "b": (3, 4), "c": (2, 4), "d": (0, 4)}
    alone = kv_migration_plan(CFG, old, new, placed, 4)
    assert migrate_pages(plan) < migrate_pages(alone)
    assert migrate_bytes(plan, CFG, 8) * 16 == migrate_bytes(alone, CFG, 8) * 11  # 4+1+2+4 of 4x4 pages


TRANSITIONS = [("4x1", "1x4"), ("4x1", "2x2"), ("2x2", "1x4"), ("1x4", "4x1"), ("2x2", "4x1"), ("1x4", "2x2")]


@pytest.mark.parametrize(
    ("cfg", "src", "dst"),
    [
        *((CFG, a, b) for a, b in [*TRANSITIONS, ("4x2", "1x8"), ("1x8", "8x1")]),
        *((SMOL, a, b) for a, b in [*TRANSITIONS, ("2x1", "1x2"), ("1x2", "2x1"), ("4x2", "1x8")]),
    ],
)
def test_kv_plan_delivers_every_needed_head_once(cfg: ModelConfig, src: str, dst: str) -> None:
    old, new = Layout.parse(src), Layout.parse(dst)
    placed = place(_reqs(2 * old.replicas, old.replicas), new.replicas, 64, ROOMY, 1, 0.7)
    plan = kv_migration_plan(cfg, old, new, placed)
    for p in placed:
        for rank in new.ranks_of(p.dst_replica):
            lo, hi = kv_head_range(cfg, new.tp, new.shard_of(rank))
            got = sorted(
                h
                for t in plan
                if t.id == p.id and t.dst == rank
                for h in range(t.dst_heads[0] + lo, t.dst_heads[1] + lo)
            )
            assert got == list(range(lo, hi)), (p.id, rank)
        for t in (t for t in plan if t.id == p.id):
            assert t.src in old.ranks_of(p.src_replica)
            slo, shi = kv_head_range(cfg, old.tp, old.shard_of(t.src))
            dlo, _ = kv_head_range(cfg, new.tp, new.shard_of(t.dst))
            assert t.src_heads[0] + slo == t.dst_heads[0] + dlo  # same global head
            assert t.src_heads[1] + slo <= shi  # the source holds it


@pytest.mark.parametrize(("src", "dst"), [*TRANSITIONS, ("2x1", "1x2"), ("1x2", "2x1")])
def test_planner_estimate_is_the_engine_plan_on_uneven_shards(src: str, dst: str) -> None:
    """The cost model's bytes for a switch (what the planner and the simulator predict) equal what the
    engine's migration plan moves for SmolLM2's 3 KV heads on 2 and 4 ranks, for a request of 37 KV tokens
    in float32, averaged over the new replicas sharing ranks with its old one."""
    old, new = Layout.parse(src), Layout.parse(dst)
    sent = []
    for d in range(old.replicas):
        for d2 in range(new.replicas):
            if set(old.ranks_of(d)) & set(new.ranks_of(d2)):
                placed = [Placement("r", d, 0, d2, 0, 37)]
                sent.append(migrate_bytes(kv_migration_plan(SMOL, old, new, placed), SMOL, 4))
    per_token = 2 * SMOL.num_layers * SMOL.num_kv_heads * SMOL.head_dim * 4
    predicted = estimated_moved_bytes(37, per_token, SMOL.num_kv_heads, old, new)
    assert predicted == pytest.approx(sum(sent) / len(sent))
    if (src, dst) == ("2x2", "1x4"):  # ranks 1 and 3 each receive one head (0 and 2) of 64 values a token
        assert sent == [2 * 2 * 37 * 64 * 2 * 4] * 2


def test_kv_plan_prefers_local_copies() -> None:
    # 2x2 -> 1x4: replica 0 was ranks 0 (KV head 0) and 2 (KV head 1); in 1x4 ranks 0, 1 need head 0
    # and ranks 2, 3 need head 1: ranks 0 and 2 copy locally, 1 and 3 receive
    old, new = Layout.parse("2x2"), Layout.parse("1x4")
    placed = place([Unfinished("a", 0, 0, Req(7, 1, 11))], 1, 64, ROOMY, 1, 0.7)
    plan = kv_migration_plan(CFG, old, new, placed)
    assert {(t.src, t.dst) for t in plan} == {(0, 0), (0, 1), (2, 2), (2, 3)}
    assert migrate_bytes(plan, CFG, 8) == 2 * 4 * 1 * 7 * 16 * 8 * 2  # ranks 1, 3 receive one head each


def test_choose_method_by_cost() -> None:
    """The engine and the planner share this one decision (rollout_worker.scheduling.costs)."""
    costs = CostModel(1e5, 0.0, 100.0, 0.0, 1.0, 50.0, 5.0)
    assert costs.choose("auto", 1_000_000, 100).method == "recompute"  # 10 ms vs 1 ms
    assert costs.choose("auto", 1_000, 10_000).method == "migrate"  # 0.01 ms vs 100 ms
    assert costs.choose("migrate", 1_000_000, 1).method == "migrate"  # explicit wins
    choice = costs.choose("auto", 2e5, 300)
    assert (choice.migrate_ms, choice.recompute_ms, choice.ms) == (2.0, 3.0, 2.0)
    assert costs.base_ms(1, 2) == 6.0 and costs.base_ms(2, 1) == 55.0  # sync + grow / shrink reshard
    placed = place(_reqs(4, 2), 1, 64, ROOMY, 1, 0.7)
    assert recompute_tokens(placed, 1) == sum(r.kv_len for r in _reqs(4, 2))
