"""The report of a local run: a resumed run's tokens/s counts only the tokens it generated (not the samples an
earlier run had written), and the timeline's axes count whole requests and whole TP sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_operator.local import report
from rollout_operator.local.result import Point, RunResult
from rollout_operator.local.runner import _tally
from rollout_worker.api.layout import Layout
from rollout_worker.api.sidecar import Sample, output_file, read_outputs

from tests.worker.sidecar.test_outputs import rec


def _sample(i: int, tokens: int) -> Sample:
    return rec(f"p{i}", 0).model_copy(update={"completion_tokens": tokens})


def _write(out: Path, samples: list[Sample]) -> None:
    with output_file(out, 0).open("ab") as f:
        for s in samples:
            f.write(s.to_line())


def _run(out: Path, seconds: float, timeline: list[Point] | None = None) -> RunResult:
    return RunResult("adaptive", Layout.parse("2x1"), out, seconds, 0, 0, {}, [], timeline or [])


def test_a_resumed_runs_tokens_per_s_counts_only_what_it_generated(tmp_path: Path) -> None:
    _write(tmp_path, [_sample(i, 100) for i in range(3)])  # an interrupted run wrote 300 tokens
    before = read_outputs(tmp_path)
    _write(tmp_path, [_sample(3 + i, 50) for i in range(2)])  # this run: 100 tokens in 4 s
    result = _run(tmp_path, 4.0)
    _tally(result, before)
    assert (result.samples, result.tokens, result.resumed) == (5, 400, 3)
    assert result.tokens_per_s == pytest.approx(25.0)  # not 400 / 4
    assert report.as_dict(result)["tokens_per_s"] == 25.0
    line = report.lines(result)[0]
    assert "400 tokens in 4.00 s (25 tok/s)" in line and "3 samples, 300 tokens were already written" in line
    again = RunResult.from_json(result.to_json(), tmp_path)  # a finished run reported again: the same figure
    assert again.tokens_per_s == pytest.approx(25.0)


def test_the_timelines_axes_have_whole_number_ticks(tmp_path: Path) -> None:
    """A switching run (TP 1 then 2) and a static one (TP 1 throughout, where matplotlib alone ticks
    0.95 .. 1.05): running requests and TP sizes are whole numbers, and the TP axis ticks the sizes run at."""
    steps = {"adaptive": [(3, 1), (2, 1), (1, 2)], "static": [(3, 1), (2, 1), (1, 1)]}
    runs = [
        _run(tmp_path, 1.5, [Point(t * 0.5, "p-0", running, tp) for t, (running, tp) in enumerate(pts)])
        for pts in steps.values()
    ]
    axes = report.timeline_figure(runs).get_axes()
    assert [a.get_ylabel() for a in axes] == ["running requests", "running requests", "TP size", "TP size"]
    for ax in axes:
        ticks = list(ax.get_yticks())
        assert len(ticks) >= 1 and all(float(t).is_integer() for t in ticks), (ax.get_ylabel(), ticks)
    assert [list(ax.get_yticks()) for ax in axes[2:]] == [[1, 2], [1]]
