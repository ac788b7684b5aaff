"""The report of a local run: a resumed run's tokens/s counts only the tokens it generated (not the samples an
earlier run had written), the timeline's axes count whole requests and whole TP sizes, a pod the planner
never switched says why (its closest call), and ``--compare static`` gives a ratio only when the run switched
(without a switch both runs did the same work, and their difference is noise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rollout_operator.control.planner_loop import Outcome
from rollout_operator.local import report
from rollout_operator.local.local_job import first_difference, outputs_equal
from rollout_operator.local.result import Comparison, Point, RunResult
from rollout_operator.local.runner import _nearest, _tally
from rollout_profiler.planning.planner import Decision
from rollout_profiler.planning.tick import TickResult
from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.api.sidecar import Sample, output_file, read_outputs
from rollout_worker.scheduling.layout import Layout

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


def _outcome(step: int, unfinished: int, action: str, gain: float, cost: float, reason: str) -> Outcome:
    decision = Decision(action, Layout.parse("2x1"), None, gain, cost, reason)
    inputs = {"step": step, "running": unfinished, "waiting": 0}
    return Outcome("p-0", TickResult(decision, None, inputs), pushed=False, new_events=[])


def test_a_pod_that_never_switched_reports_the_planners_closest_call(tmp_path: Path) -> None:
    """The report says why the planner kept a pod: the weighed decision whose gain came nearest its cost
    (decisions not weighed, such as a cooldown, are not calls); a pod that switched reports its switch."""
    closest: dict[str, dict[str, Any]] = {}
    ticks = [
        _outcome(5, 32, "keep", 0.0, 0.0, "ranks not ready: [1]"),
        _outcome(40, 20, "keep", 100.0, 900.0, "far"),
        _outcome(90, 6, "keep", 700.0, 800.0, "near"),
        _outcome(120, 2, "keep", 50.0, 800.0, "farther"),
    ]
    for o in ticks:
        _nearest(closest, [o])
    assert closest["p-0"] == {
        "step": 90,
        "unfinished": 6,
        "gain_ms": 700.0,
        "cost_ms": 800.0,
        "reason": "near",
    }
    result = _run(tmp_path, 1.0)
    result.closest = closest
    assert (
        "  p-0: stayed 2x1: the planner's closest call, at step 90 with 6 unfinished: near"
        in report.lines(result)
    )
    assert RunResult.from_json(result.to_json(), tmp_path).closest == closest
    switch = ReconfigEvent.model_validate(
        {"step": 100, "time_s": 1.0, "src": "2x1", "dst": "1x2", "requested": "auto", "method": "migrate",
         "reason": "plan"}
    )  # fmt: skip
    result.events = {"p-0": [switch]}
    assert not any("closest call" in line for line in report.lines(result))


def test_compared_outputs_name_each_differing_sample_and_where_it_first_differs(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    same = [_sample(i, 2) for i in range(3)]
    _write(a, same)
    assert outputs_equal(a, a) == (True, "3 samples, identical")
    changed = [same[0], same[1].model_copy(update={"output_ids": [1, 9]}), same[2]]
    changed[2] = changed[2].model_copy(update={"output_ids": [1, 2, 3]})  # extends the other: differs at 2
    _write(b, changed)
    assert outputs_equal(a, b) == (False, "3 samples, 2 differ: p1/0 at token 1, p2/0 at token 2")
    assert first_difference([1, 2], [1, 2]) == 2 and first_difference([], [4]) == 0


def _switch(outcome: str = "committed") -> ReconfigEvent:
    return ReconfigEvent.model_validate(
        {"step": 100, "time_s": 1.0, "src": "2x1", "dst": "1x2", "requested": "auto", "method": "migrate",
         "reason": "plan", "outcome": outcome}
    )  # fmt: skip


def _compared(tmp_path: Path, adaptive_s: float, static_s: float, events: list[ReconfigEvent]) -> Comparison:
    adaptive = _run(tmp_path / "adaptive", adaptive_s)
    adaptive.events = {"p-0": events}
    static = RunResult("static", Layout.parse("2x1"), tmp_path / "static", static_s, 0, 0, {"p-0": []}, [])
    return Comparison(adaptive, static, True, "32 samples, identical")


def test_a_comparison_without_a_switch_reports_the_same_work_and_the_difference_as_noise(
    tmp_path: Path,
) -> None:
    """The planner kept 2x1 throughout (the issue's run: the first side paid what the second found warm, or
    the machine was busier): no ratio, no 'as fast', the difference with its spread."""
    c = _compared(tmp_path, 180.01, 129.99, [])
    assert report.compare_lines(c) == [
        "compare: adaptive 180.01 s vs static 129.99 s: the same work (no switch: 2x1 throughout in both "
        "runs), so the 50.02 s between them is noise: 155.00 s ± 25.01 s (±16.1%), not a speed-up or "
        "slow-down; outputs identical (32 samples, identical)"
    ]
    got = report.compare_dict(c)
    assert (got["same_work"], got["spread_s"], got["identical"]) == (True, 25.01, True)
    assert got["speedup"] == pytest.approx(129.99 / 180.01)  # the JSON keeps its field


def test_a_comparison_after_a_switch_reports_the_ratio(tmp_path: Path) -> None:
    c = _compared(tmp_path, 40.0, 50.0, [_switch()])
    assert report.compare_lines(c) == [
        "compare: adaptive 40.00 s vs static 50.00 s: adaptive is 1.25x as fast; "
        "outputs identical (32 samples, identical)"
    ]
    got = report.compare_dict(c)
    assert (got["same_work"], got["spread_s"], got["speedup"]) == (False, None, 1.25)
    # a switch tried and rolled back still spent the run's time differently: a ratio, not noise
    rolled_back = _compared(tmp_path, 40.0, 50.0, [_switch("rolled_back")])
    assert "adaptive is 1.25x as fast" in report.compare_lines(rolled_back)[0]


def test_a_comparison_whose_outputs_differ_in_a_lossy_dtype_says_why(tmp_path: Path) -> None:
    c = _compared(tmp_path, 10.0, 10.0, [])
    c = Comparison(c.run, c.static, False, "32 samples, 1 differ: p1/0 at token 7")
    first, why = report.compare_lines(c, "float32")
    assert first.endswith(
        "10.00 s ± 0.00 s (±0.0%), not a speed-up or slow-down; "
        "outputs DIFFER (32 samples, 1 differ: p1/0 at token 7)"
    )
    assert why.startswith("  float32 is not lossless with the default kernels")
    assert report.compare_lines(c) == [first]  # lossless (float64, deterministic kernels): the caller fails
