"""Text tables and plots of simulation results (matplotlib with the Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from rollout_profiler.sim.simulator import SimResult


def table(results: dict[str, SimResult]) -> str:
    """One row per policy: latency, change vs the best static layout, GPU-busy share, switches."""
    statics = [r.latency_s for p, r in results.items() if p.startswith("static:")]
    best = min(statics) if statics else None
    head = ("policy", "latency_s", "vs_best_static", "gpu_busy", "switches")
    rows = ["{:<12} {:>10} {:>15} {:>9} {:>9}  schedule".format(*head)]
    for name, r in results.items():
        rel = f"{(r.latency_s / best - 1) * 100:+.1f}%" if best else "-"
        sched = ", ".join(f"{x.src}->{x.dst}@{x.step}({x.method})" for x in r.reconfigs) or "-"
        n_sw = len(r.reconfigs)
        rows.append(f"{name:<12} {r.latency_s:>10.2f} {rel:>15} {r.gpu_busy:>9.3f} {n_sw:>9}  {sched}")
    return "\n".join(rows)


def plot(results: dict[str, SimResult], path: str | Path, title: str = "") -> Path:
    """Running requests (top) and TP size (bottom) over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_run, ax_tp) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=(3, 1))
    for name, r in results.items():
        ts = [x[0] for x in r.timeline] + [r.latency_s]
        running = [x[1] for x in r.timeline] + [0]
        tps = [x[2] for x in r.timeline] + [r.timeline[-1][2] if r.timeline else 0]
        ax_run.step(ts, running, where="post", label=f"{name} ({r.latency_s:.1f} s)")
        ax_tp.step(ts, tps, where="post", label=name)
    ax_run.set_ylabel("running requests")
    ax_run.legend(fontsize=8)
    ax_tp.set_ylabel("TP size")
    ax_tp.set_xlabel("time (s)")
    if title:
        ax_run.set_title(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
