from __future__ import annotations

import pytest
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout, candidate_layouts, parse_candidates, tp_problem


def test_rank_layout_replica_is_rank_mod_d() -> None:
    lay = Layout(2, 2)
    assert [lay.replica_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [lay.shard_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert lay.groups() == [[0, 2], [1, 3]]
    assert Layout(4, 2).ranks_of(1) == [1, 5]


def test_parse_and_errors() -> None:
    assert Layout.parse(" 4x2 ") == Layout(4, 2)
    with pytest.raises(UserError, match="DxT"):
        Layout.parse("4by2")
    with pytest.raises(UserError, match="does not divide"):
        Layout.for_tp(4, 3)
    with pytest.raises(UserError, match=r"candidates\[1\]"):
        parse_candidates("4x1,3x1", 4)


def test_candidates_respect_heads() -> None:
    assert [str(x) for x in candidate_layouts(8, 8, 512)] == ["8x1", "4x2", "2x4", "1x8"]
    # head counts need not divide TP (uneven head shards): SmolLM2-135M's 9 heads / 3 KV heads, TP 2 and 4
    assert [str(x) for x in candidate_layouts(4, 9, 49152)] == ["4x1", "2x2", "1x4"]
    assert [str(x) for x in candidate_layouts(6, 12, 516)] == ["6x1", "3x2", "2x3", "1x6"]
    # ... but every rank needs a query head
    assert [str(x) for x in candidate_layouts(8, 3, 512)] == ["8x1", "4x2"]
    assert "num_attention_heads=3" in (tp_problem(4, 3, 512) or "")
    # the vocabulary is sharded too: TP 4 cannot split 514 logits
    assert [str(x) for x in candidate_layouts(4, 8, 514)] == ["4x1", "2x2"]
    assert "vocab_size" in (tp_problem(4, 8, 514) or "")
    assert tp_problem(3, 8, 512) is not None
