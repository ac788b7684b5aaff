"""The report of a local run: generation seconds, tokens/s, every switch with its predicted and actual cost,
where the outputs are, what the samples say (lengths, rewards, pass@k: :mod:`rollout_stats`); as printed
lines, as JSON, and as a timeline PNG (running requests and TP size over time per pod, switches marked).
With ``--compare static``, the comparison of the two runs: a ratio when the run switched, and when neither
switched (the same layout throughout, the same work) the difference as noise with its spread."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rollout_profiler.plot import count_ticks, png, pyplot
from rollout_worker.api.sidecar import read_outputs

from rollout_operator.local.result import Comparison, RunResult
from rollout_operator.local.rollout_stats import RolloutStats, stats_of

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def switch_rows(r: RunResult) -> list[dict[str, Any]]:
    """Every reconfiguration of the run, one row each (the report's and the benchmark's)."""
    return [
        {
            "pod": pod,
            "step": e.step,
            "time_s": e.time_s,
            "from": str(e.src),
            "to": str(e.dst),
            "method": e.method,
            "outcome": e.outcome,
            "reason": e.reason,
            "predicted_ms": e.predicted_ms,
            "actual_ms": e.actual_ms,
        }
        for pod, evs in r.events.items()
        for e in evs
    ]


def rollout_stats(r: RunResult) -> RolloutStats | None:
    """What the run's samples say (None in service mode, or when its outputs are gone)."""
    return None if r.service else stats_of(read_outputs(r.out_dir))


def as_dict(r: RunResult) -> dict[str, Any]:
    stats = rollout_stats(r)
    return {
        "policy": r.policy,
        "initial_layout": str(r.layout),
        "output": str(r.out_dir),
        "generation_seconds": round(r.seconds, 3),
        "samples": r.samples,
        "tokens": r.tokens,
        "generated_tokens": r.generated_tokens,
        "tokens_per_s": round(r.tokens_per_s, 1),
        "reconfigurations": switch_rows(r),
        "decisions": r.decisions,
        "closest_calls": r.closest,
        "resumed_samples": r.resumed,
        "reused": r.reused,
        "rollout": stats.to_dict() if stats is not None else None,
    }


def lines(r: RunResult) -> list[str]:
    switches = _switches(switch_rows(r)) + _stayed(r)
    if r.service:
        out = [
            f"{r.policy} (service): {r.samples} requests served in {r.seconds:.2f} s, starting as {r.layout}"
        ]
        return out + switches
    if r.reused:
        how = " (recorded when it ran)"
    elif r.resumed:
        how = (
            f" (resumed: {r.resumed} samples, {r.resumed_tokens} tokens were already written; "
            f"the time and tok/s cover the {r.generated_tokens} tokens generated now)"
        )
    else:
        how = ""
    out = [
        f"{r.policy}: {r.samples} samples, {r.tokens} tokens in {r.seconds:.2f} s "
        f"({r.tokens_per_s:.0f} tok/s){how}, starting as {r.layout}; outputs in {r.out_dir}"
    ]
    stats = rollout_stats(r)
    return out + switches + (stats.lines() if stats is not None else [])


def _stayed(r: RunResult) -> list[str]:
    """Why the planner kept each pod that never switched: its closest call."""
    out = []
    for pod, c in sorted(r.closest.items()):
        if not r.events.get(pod):
            out.append(
                f"  {pod}: stayed {r.layout}: the planner's closest call, at step {c['step']} with "
                f"{c['unfinished']} unfinished: {c['reason']}"
            )
    return out


def _switches(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in rows:
        out.append(
            f"  {e['pod']}: {e['from']} -> {e['to']} ({e['method']}) at step {e['step']}, "
            f"t={e['time_s']:.2f} s: predicted {e['predicted_ms']:.1f} ms, took {e['actual_ms'] or 0:.1f} ms "
            f"({e['reason']})"
        )
    return out


def compare_lines(c: Comparison, lossy_dtype: str | None = None) -> list[str]:
    """The comparison's line, and where the outputs differ in a dtype whose default kernels round by batch
    and layout (``lossy_dtype``), why. Runs that did the same work (no switch) get no ratio: their times
    differ by what else the machine ran, not by what the planner did."""
    a, b = c.run, c.static
    if c.same_work:
        mean, spread = (a.seconds + b.seconds) / 2, abs(a.seconds - b.seconds) / 2
        verdict = (
            f"the same work (no switch: {a.layout} throughout in both runs), so the {2 * spread:.2f} s "
            f"between them is noise: {mean:.2f} s ± {spread:.2f} s (±{_percent(spread, mean)}), not a "
            "speed-up or slow-down"
        )
    else:
        verdict = f"{a.policy} is {c.ratio:.2f}x as fast"
    partial = " (a resumed run: its time covers only what it generated)" if c.partial else ""
    out = [
        f"compare: {a.policy} {a.seconds:.2f} s vs static {b.seconds:.2f} s: {verdict}{partial}; "
        f"outputs {'identical' if c.identical else 'DIFFER'} ({c.detail})"
    ]
    if not c.identical and lossy_dtype is not None:
        out.append(
            f"  {lossy_dtype} is not lossless with the default kernels: a batch or TP change rounds the "
            "logits differently, and a sampled token can flip where two tokens tie (docs: Deterministic "
            "kernels); set spec.engine.deterministic: true for identical tokens"
        )
    return out


def compare_dict(c: Comparison) -> dict[str, Any]:
    """The comparison in the JSON report: ``speedup`` is static seconds over the run's; where ``same_work``
    (no switch) it measures noise, whose size is ``spread_s`` (half the difference)."""
    return {
        "identical": c.identical,
        "detail": c.detail,
        "speedup": c.ratio,
        "partial": c.partial,
        "same_work": c.same_work,
        "spread_s": round(abs(c.run.seconds - c.static.seconds) / 2, 3) if c.same_work else None,
    }


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0%"


def report_json(results: list[RunResult], extra: dict[str, Any] | None = None) -> str:
    return json.dumps({"runs": [as_dict(r) for r in results], **(extra or {})}, indent=1) + "\n"


def timeline_png(results: list[RunResult]) -> bytes:
    """The timeline (:func:`timeline_figure`) as PNG bytes."""
    return png(timeline_figure(results))


def timeline_figure(results: list[RunResult]) -> Figure:
    """One panel per run: running requests per pod (left axis) and TP size (right axis) over time; both
    axes count, so their ticks are whole numbers."""
    fig, axes = pyplot().subplots(len(results), 1, figsize=(9, 3.2 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        tp_ax = ax.twinx()
        for pod in sorted({s.pod for s in r.timeline}):
            pts = [s for s in r.timeline if s.pod == pod]
            ax.plot([s.t for s in pts], [s.running for s in pts], label=f"{pod} running")
            tp_ax.step(
                [s.t for s in pts], [s.tp for s in pts], where="post", linestyle="--", label=f"{pod} TP"
            )
        for evs in r.events.values():
            for e in evs:
                ax.axvline(e.time_s, color="grey", alpha=0.5, linewidth=0.8)
        ax.set_title(f"{r.policy}: {r.seconds:.2f} s, {r.tokens_per_s:.0f} tok/s")
        ax.set_xlabel("seconds since generation started")
        ax.set_ylabel("running requests")
        tp_ax.set_ylabel("TP size")
        count_ticks(ax, tp_ax, (s.tp for s in r.timeline))
        if r.timeline:  # a run with no samples recorded (e.g. resumed with nothing left) has no lines
            ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig
