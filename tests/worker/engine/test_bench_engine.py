"""The engine benchmark runs end to end on a minimal grid and reports what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_worker.engine.bench import run_engine_bench

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
