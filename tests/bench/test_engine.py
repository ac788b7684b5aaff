"""The engine benchmark runs end to end on a minimal grid and reports what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_bench.engine import run_engine_bench

pytestmark = pytest.mark.multiproc


def test_engine_bench_minimal_grid(tmp_path: Path) -> None:
    lines: list[str] = []
    out = tmp_path / "bench.json"
    report = run_engine_bench("tiny", 2, [1], [16], 2, 1, "float32", "cpu", out, lines.append)
    assert json.loads(out.read_text())["preset"] == "tiny"
    assert {p["layout"] for p in report["grid"]} == {"2x1", "1x2"}
    assert all(p["ms"] > 0 for p in report["grid"])
    pairs = {(r["from"], r["to"], r["method"]) for r in report["reconfig"]}
    assert ("2x1", "1x2", "migrate") in pairs and ("1x2", "2x1", "recompute") in pairs
    assert all(r["phases_ms"]["total_ms"] > 0 for r in report["reconfig"])
    assert any("speed-up" in line or "reconfiguration" in line for line in lines)


def test_engine_bench_measures_the_deterministic_kernels_side_by_side() -> None:
    lines: list[str] = []
    report = run_engine_bench(
        "tiny", 2, [1, 4], [16], 2, 1, "float32", "cpu", None, lines.append, deterministic="both"
    )
    cost = report["deterministic_cost"]
    assert {(r["layout"], r["batch"]) for r in cost} == {(p["layout"], p["batch"]) for p in report["grid"]}
    assert all(r["tokens_per_s_ratio"] == r["default_ms"] / r["deterministic_ms"] > 0 for r in cost)
    assert report["grid_default"] != report["grid"]  # two grids, each measured
    assert any(line.startswith("deterministic kernels vs default") for line in (ln.strip() for ln in lines))
