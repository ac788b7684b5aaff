"""``rolloutctl bench spec``: the benchmark's machinery on the tiny model (one run: off and always at 2x1
and 1x2 after an earlier iteration, every token compared), its report and its table (the real model's
benchmark runs for minutes and stays out of CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_bench.spec import LAYOUTS, run_spec_bench
from rollout_bench.tables import KINDS
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling

pytestmark = pytest.mark.multiproc


def test_the_benchmark_compares_off_and_each_policy_and_renders(tiny32: Path) -> None:
    loops = [(5, 9) * 4, (7, 7, 8) * 3]  # the tiny model's greedy outputs loop
    samplings = [Sampling(), Sampling(temperature=0.7, seed=3)]
    specs = [  # caps apart, so the last quarter finishes after the rest (the tail)
        RequestSpec(f"p{i}-s{j}", p, 16 + 12 * (2 * i + j), s)
        for i, p in enumerate(loops)
        for j, s in enumerate(samplings)
    ]
    before = [RequestSpec(f"b{i}", p, 40, Sampling(temperature=0.7, seed=11)) for i, p in enumerate(loops)]
    lines: list[str] = []
    report = run_spec_bench(
        tiny32, specs, 1, 4, None, lines.append, {"model": "tiny", "workload": "loops"}, before, ("always",)
    )
    assert [(r["layout"], r["policy"]) for r in report["rows"]] == [
        (lay, mode) for lay in LAYOUTS for mode in ("off", "always")
    ]
    for off, on in zip(report["rows"][::2], report["rows"][1::2], strict=True):
        assert off["speedup"] == 1.0 and off["verify_steps"] == 0
        assert on["speedup"] == pytest.approx(off["s"] / on["s"])
        assert on["verify_steps"] > 0 and on["accept_length"] > 1.0
        assert on["decode_steps"] < off["decode_steps"]  # verify steps replaced decode steps
        assert on["tail_tokens_per_s"] > 0 and on["tail_speedup"] is not None
    assert report["requests_before"] == 2 and 0 < report["tokens"] <= 16 + 28 + 40 + 52
    table = KINDS["spec"](report)
    assert "| 2x1 | off |" in table[-4] and "| 1x2 | always |" in table[-1]
    assert "earlier iteration of 2 requests" in table[0] and any("n-gram" in line for line in lines[-6:])
