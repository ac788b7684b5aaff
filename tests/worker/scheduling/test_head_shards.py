"""Uneven head shards: which query and KV heads each shard owns, for head counts TP does not divide."""

from __future__ import annotations

import pytest
from rollout_worker.scheduling.head_shards import (
    kv_head_range,
    max_kv_heads,
    max_q_heads,
    moved_kv_fraction,
    q_head_range,
)
from rollout_worker.scheduling.layout import Layout


@pytest.mark.parametrize(("heads", "kv"), [(9, 3), (8, 2), (12, 4), (14, 2), (15, 5), (6, 6), (7, 1)])
def test_every_tp_size_gets_whole_heads_of_its_own_groups(heads: int, kv: int) -> None:
    group = heads // kv
    for tp in range(1, heads + 1):
        q = [q_head_range(heads, kv, tp, s) for s in range(tp)]
        k = [kv_head_range(kv, tp, s) for s in range(tp)]
        # the query heads are partitioned in order, every shard gets at least one
        assert [lo for lo, _ in q] == [0, *(hi for _, hi in q[:-1])] and q[-1][1] == heads
        assert all(hi > lo for lo, hi in q)
        for (qlo, qhi), (klo, khi) in zip(q, k, strict=True):
            # a shard holds exactly the KV heads of its query heads: plain GQA on each rank
            assert (klo, khi) == (qlo // group, (qhi - 1) // group + 1), (tp, q, k)
            assert (qhi - qlo) % (khi - klo) == 0 and (khi - klo == 1 or qhi - qlo == (khi - klo) * group)
        if tp <= kv:  # no KV head stored twice
            assert sum(hi - lo for lo, hi in k) == kv
        assert max_q_heads(heads, kv, tp) == max(hi - lo for lo, hi in q)
        assert max_kv_heads(kv, tp) == max(hi - lo for lo, hi in k)


def test_widest_shards_of_smollm2() -> None:
    """What bounds a rank: 6 query heads and 2 KV heads at TP 2, 3 and 1 at TP 4 (as padding to 12 would)."""
    assert [max_q_heads(9, 3, tp) for tp in (1, 2, 4)] == [9, 6, 3]
    assert [max_kv_heads(3, tp) for tp in (1, 2, 4)] == [3, 2, 1]


def test_even_counts_keep_the_equal_split() -> None:
    assert [q_head_range(8, 2, 4, s) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(2, 8, s) for s in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4


L = Layout.parse


@pytest.mark.parametrize(
    ("src", "dst", "kv3", "kv2"),
    [
        # 3 KV heads over TP 2 are held 1 + 2: either replica of 2x1 sends the other rank its part
        ("2x1", "1x2", 1 / 2, 1 / 2),
        ("1x2", "2x1", 1 / 2, 1 / 2),
        # 1x4 holds KV heads 0, 0, 1, 2: a replica of 4x1 keeps one and sends 3 (a head per KV head)
        ("4x1", "1x4", 1.0, 3 / 2),
        ("1x4", "4x1", 2 / 3, 1 / 2),
        # 2x2 -> 1x4: ranks 0, 2 (heads [0], [1, 2]) keep 0 and 1; ranks 1, 3 receive 0 and 2
        ("2x2", "1x4", 2 / 3, 1.0),
        ("1x4", "2x2", 1 / 3, 0.0),
        ("4x1", "2x2", 1 / 2, 1 / 2),
    ],
)
def test_moved_kv_fraction_counts_uneven_and_duplicated_heads(
    src: str, dst: str, kv3: float, kv2: float
) -> None:
    assert moved_kv_fraction(3, L(src), L(dst)) == pytest.approx(kv3)
    assert moved_kv_fraction(2, L(src), L(dst)) == pytest.approx(kv2)
