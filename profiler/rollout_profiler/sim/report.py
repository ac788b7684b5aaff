"""Text tables and plots of simulation results (matplotlib with the Agg backend, imported lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_profiler.plot import count_ticks, png, pyplot
from rollout_profiler.sim.config import SimResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def table(results: dict[str, SimResult]) -> str:
    """One row per policy: latency, change vs the best static layout, GPU-busy share, switches (with the
    time and unfinished requests of each), preemptions; the bounds have no GPU-busy share."""
    statics = [r.latency_s for p, r in results.items() if p.startswith("static:")]
    best = min(statics) if statics else None
    head = ("policy", "latency_s", "vs_best_static", "gpu_busy", "switches", "preempted")
    rows = ["{:<18} {:>10} {:>15} {:>9} {:>9} {:>10}  schedule".format(*head)]
    for name, r in results.items():
        rel = f"{(r.latency_s / best - 1) * 100:+.1f}%" if best else "-"
        sched = ", ".join(
            f"{x.src}->{x.dst}@{x.time_s:.1f}s/{x.requests_running + x.requests_waiting}({x.method})"
            for x in r.reconfigs
        )
        busy = f"{r.gpu_busy:.3f}" if r.gpu_busy else "-"
        rows.append(
            f"{name:<18} {r.latency_s:>10.2f} {rel:>15} {busy:>9} {len(r.reconfigs):>9} {r.preemptions:>10}  "
            f"{sched or r.detail or '-'}"
        )
    return "\n".join(rows)


def plot_png(results: dict[str, SimResult], title: str = "") -> bytes:
    """:func:`plot_figure` as PNG bytes."""
    return png(plot_figure(results, title))


def plot_figure(results: dict[str, SimResult], title: str = "") -> Figure:
    """Unfinished requests (top) and TP size (bottom) over time, one line per policy (bounds have none)."""
    fig, (ax_run, ax_tp) = pyplot().subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=(3, 1))
    for name, r in results.items():
        if not r.timeline:
            continue
        ts = [x[0] for x in r.timeline] + [r.latency_s]
        running = [x[1] for x in r.timeline] + [0]
        tps = [x[2] for x in r.timeline] + [r.timeline[-1][2] if r.timeline else 0]
        ax_run.step(ts, running, where="post", label=f"{name} ({r.latency_s:.1f} s)")
        ax_tp.step(ts, tps, where="post", label=name)
    ax_run.set_ylabel("unfinished requests")
    ax_run.legend(fontsize=8)
    ax_tp.set_ylabel("TP size")
    ax_tp.set_xlabel("time (s)")
    if title:
        ax_run.set_title(title)
    count_ticks(ax_run, ax_tp, (x[2] for r in results.values() for x in r.timeline))
    fig.tight_layout()
    return fig
