"""``rolloutctl bench lossless``'s pure parts: thresholds, differences, the plan's checks, the table and the
failures (the benchmark itself runs the engine for minutes and stays out of CI)."""

from __future__ import annotations

from typing import Any

import pytest
from rollout_bench.lossless import (
    CHAINS,
    REFERENCE,
    Case,
    failures,
    first_difference,
    record,
    table,
    thresholds,
)

CHAIN = Case("2x1", (("1x2", "migrate"), ("2x1", "recompute")))


def _ev(src: str, dst: str, method: str, mid: int = 2, moved: int = 10, outcome: str = "committed") -> Any:
    return {
        "src": src,
        "dst": dst,
        "method": method,
        "outcome": outcome,
        "requests_mid_decode": mid,
        "kv_bytes_moved": moved if method == "migrate" else 0,
        "kv_tokens_recomputed": moved if method == "recompute" else 0,
    }


def test_thresholds_spread_and_refuse_too_few_requests() -> None:
    assert thresholds(16, 4) == [13, 9, 5, 1]
    assert thresholds(8, 4) == [7, 5, 3, 1]
    assert thresholds(9, 2) == [8, 1]
    assert thresholds(8, 0) == []
    with pytest.raises(ValueError, match="too few"):
        thresholds(7, 4)
    assert [t.unfinished_at_most for t in CHAINS[1].triggers(8)] == [7, 5, 3, 1]
    assert [(str(t.layout), t.method) for t in CHAINS[1].triggers(8)][2] == ("2x2", "migrate")


def test_case_names() -> None:
    assert REFERENCE.name == "2x1" and REFERENCE.world == 2
    assert CHAIN.name == "2x1 -m-> 1x2 -r-> 2x1"
    assert CHAINS[1].world == 4


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # one ended early (EOS)
    assert first_difference([], [7]) == 0


def test_record_counts_differences_and_checks_the_plan() -> None:
    ref = {"p0": [1, 2, 3], "p1": [4, 5], "p2": [6]}
    got = {"p0": [1, 2, 9], "p1": [4, 5], "p2": [8, 8]}
    ok = [_ev("2x1", "1x2", "migrate"), _ev("1x2", "2x1", "recompute")]
    rec = record(CHAIN, ref, got, ok, spanning=1)
    assert (rec["differ"], rec["first_difference"], rec["samples"], rec["tokens"]) == (
        2,
        {"p0": 2, "p2": 0},
        3,
        6,
    )
    assert rec["problems"] == []
    assert record(CHAIN, ref, ref, ok, spanning=0)["problems"] == [
        "no request ran on every layout of the chain"
    ]
    bad = [
        _ev("2x1", "1x2", "recompute", mid=0),
        _ev("1x2", "2x1", "recompute", moved=0, outcome="rolled_back"),
    ]
    assert record(CHAIN, ref, ref, bad, spanning=1)["problems"] == [
        "switch 1: 2x1 -> 1x2 (recompute), planned 2x1 -> 1x2 (migrate)",
        "switch 1: no request mid-decode",
        "switch 1: no KV cache moved",
        "switch 2: rolled_back",
        "switch 2: no KV cache recomputed",
    ]
    assert record(CHAIN, ref, ref, ok[:1], spanning=1)["problems"] == ["2 switch(es) planned, 1 happened"]


def test_table_and_failures() -> None:
    ref = {"p0": [1, 2, 3], "p1": [4, 5, 6]}
    evs = [_ev("2x1", "1x2", "migrate", mid=3), _ev("1x2", "2x1", "recompute", mid=1)]
    report = {
        "preset": "smollm2-135m",
        "requests": 2,
        "max_new_tokens": 3,
        "runs": {
            "float32": [
                record(REFERENCE, ref, ref, [], 2),
                record(CHAIN, ref, {"p0": [1, 2, 0], "p1": [4, 0, 0]}, evs, 1),
            ],
            "float64": [record(REFERENCE, ref, ref, [], 2), record(CHAIN, ref, ref, evs, 1)],
        },
    }
    lines = table(report)
    assert lines[2].startswith("| dtype | run | samples that differ |")
    assert lines[4:] == [
        "| float32 | 2x1 | 0/2 | - | - |",
        "| float32 | 2x1 -m-> 1x2 -r-> 2x1 | 2/2 | p1@1, p0@2 | 3, 1 |",
        "| float64 | 2x1 | 0/2 | - | - |",
        "| float64 | 2x1 -m-> 1x2 -r-> 2x1 | 0/2 | - | 3, 1 |",
    ]
    assert failures(report) == []  # float32 may differ
    report["runs"]["float32 deterministic"] = [record(CHAIN, ref, {"p0": [1, 2, 0], "p1": [4, 5, 6]}, evs, 1)]
    assert failures(report) == ["float32 deterministic 2x1 -m-> 1x2 -r-> 2x1: 1 of 2 samples differ"]
    del report["runs"]["float32 deterministic"]
    report["runs"]["float64"][1] = record(CHAIN, ref, {"p0": [1, 2, 3], "p1": [4, 5, 7]}, evs[:1], 1)
    assert failures(report) == [
        "float64 2x1 -m-> 1x2 -r-> 2x1: 1 of 2 samples differ",
        "float64 2x1 -m-> 1x2 -r-> 2x1: 2 switch(es) planned, 1 happened",
    ]
