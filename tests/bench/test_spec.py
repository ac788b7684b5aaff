"""``rolloutctl bench spec``: the benchmark's machinery on the tiny model (one run: off and on at 2x1 and
1x2, every token compared), its report and its table (the real model's benchmark runs for minutes and stays
out of CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_bench.spec import LAYOUTS, run_spec_bench
from rollout_bench.tables import KINDS
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling

pytestmark = pytest.mark.multiproc


def test_the_benchmark_compares_off_and_on_and_renders(tiny32: Path) -> None:
    loops = [(5, 9) * 4, (7, 7, 8) * 3]  # the tiny model's greedy outputs loop
    samplings = [Sampling(), Sampling(temperature=0.7, seed=3)]
    specs = [
        RequestSpec(f"p{i}-s{j}", p, 40, s) for i, p in enumerate(loops) for j, s in enumerate(samplings)
    ]
    lines: list[str] = []
    report = run_spec_bench(tiny32, specs, 1, 4, None, lines.append, {"model": "tiny", "workload": "loops"})
    assert [r["layout"] for r in report["rows"]] == list(LAYOUTS)
    for r in report["rows"]:
        assert r["speedup"] == pytest.approx(r["off_s"] / r["on_s"])
        assert r["verify_steps"] > 0 and r["accept_length"] > 1.0
        assert r["decode_steps_on"] < r["decode_steps_off"]  # verify steps replaced decode steps
    assert 0 < report["tokens"] <= 4 * 40
    table = KINDS["spec"](report)
    assert "| 2x1 |" in table[-2] and "| 1x2 |" in table[-1] and any("n-gram" in line for line in lines[-4:])
