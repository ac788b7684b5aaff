"""`simulate --plot`'s figure: its axes count requests and TP sizes, so their ticks are whole numbers (the
static policies' flat TP line alone made matplotlib tick 0.95 .. 1.05)."""

from __future__ import annotations

from rollout_profiler.sim.config import SimResult
from rollout_profiler.sim.report import plot_figure


def test_the_plot_ticks_whole_requests_and_the_tp_sizes_run_at() -> None:
    results = {
        "static:1": SimResult("static:1", 3.0, 0.5, [], [(0.0, 9, 1), (1.0, 4, 1), (2.0, 1, 1)]),
        "static:2": SimResult("static:2", 2.5, 0.5, [], [(0.0, 9, 1), (1.5, 2, 1)]),
    }
    run_ax, tp_ax = plot_figure(results).get_axes()
    assert all(float(t).is_integer() for t in run_ax.get_yticks()), list(run_ax.get_yticks())
    assert list(tp_ax.get_yticks()) == [1]
