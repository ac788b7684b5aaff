"""``rolloutctl bench run``: one job, run adaptive and static at every candidate layout (independent
replicas), round after round on the same machine, the order rotated each round, every trial from empty
outputs. Per trial: generation seconds, tokens/s, the switches with their predicted and actual cost, and the
latency of the sidecar's ``GET /v1/progress`` under load (a prober in its own process, every 20 ms, while
the pods decode). The summary: each policy's median time, the median over rounds of adaptive / best
static of the same round, the share of adaptive's time spent switching, the progress p99, and whether every
trial drew the same tokens."""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_operator.local.local_job import Prepared, outputs_equal, planning
from rollout_operator.local.report import switch_rows
from rollout_operator.local.runner import ENDPOINTS, PodRun, run_pods
from rollout_worker.scheduling.layout import Layout
from rollout_worker.web.probe import Prober, percentile

Echo = Callable[[str], Any]
PROGRESS = "/v1/progress"


@dataclass
class Trial:
    round: int
    policy: str  # adaptive | static:DxT
    seconds: float
    tokens: int
    switches: list[dict[str, Any]]
    progress_ms: list[float] = field(repr=False)
    identical: bool | None = None  # the same tokens as the first trial (None: the first)

    @property
    def switch_ms(self) -> float:
        return sum(float(s["actual_ms"] or 0.0) for s in self.switches if s["outcome"] == "committed")

    def row(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "policy": self.policy,
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
            "switches": self.switches,
            "switch_ms": round(self.switch_ms, 1),
            "progress_probes": len(self.progress_ms),
            "progress_p50_ms": round(percentile(self.progress_ms, 0.5), 2),
            "progress_p99_ms": round(percentile(self.progress_ms, 0.99), 2),
            "identical_to_first": self.identical,
        }


class _ProbeOnReady:
    """Starts the prober at the first progress report (the pods are ready, the job submitted)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.prober: Prober | None = None

    def __call__(self, progress: dict[str, Any]) -> None:
        if self.prober is not None:
            return
        ends = json.loads((self.out_dir / ENDPOINTS).read_text())
        token = Path(ends["sidecar_token_file"]).read_text().strip()
        url = ends["pods"][0]["sidecar_url"]
        self.prober = Prober(url, [PROGRESS], {"Authorization": f"Bearer {token}"}).__enter__()

    def stop(self) -> list[float]:
        if self.prober is None:
            return []
        self.prober.__exit__(None, None, None)
        return self.prober.ms.get(PROGRESS, [])


def _policies(prep: Prepared) -> list[tuple[str, Layout]]:
    return [("adaptive", prep.layout)] + [(f"static:{c}", c) for c in prep.candidates]


def _trial(prep: Prepared, r: int, name: str, layout: Layout, out_dir: Path) -> Trial:
    if out_dir.exists():
        shutil.rmtree(out_dir)  # every trial generates everything
    probe = _ProbeOnReady(out_dir)
    run = PodRun(prep.loaded, name, layout, prep.candidates, out_dir, planning(prep, name))
    try:
        res = asyncio.run(run_pods(run, probe, lambda _: None))
    finally:
        ms = probe.stop()
    return Trial(r, name, res.seconds, res.tokens, switch_rows(res), ms)


def bench_job(prep: Prepared, rounds: int, work: Path, echo: Echo) -> dict[str, Any]:
    pols = _policies(prep)
    trials: list[Trial] = []
    first: Path | None = None
    for r in range(rounds):
        order = pols[r % len(pols) :] + pols[: r % len(pols)]
        for name, layout in order:
            out_dir = work / f"round-{r + 1}" / name.replace(":", "-")
            t = _trial(prep, r + 1, name, layout, out_dir)
            if first is None:
                first = out_dir
            else:
                t.identical, _ = outputs_equal(first, out_dir)
            trials.append(t)
            row = t.row()
            echo(
                f"round {r + 1}/{rounds} {name:>12}: {t.seconds:7.2f} s, {row['tokens_per_s']:6.1f} tok/s, "
                f"{len(t.switches)} switch(es) ({t.switch_ms:.0f} ms), /v1/progress p99 "
                f"{row['progress_p99_ms']:.1f} ms over {len(t.progress_ms)} probes"
            )
    return summarize(prep, trials, rounds)


def summarize(prep: Prepared, trials: list[Trial], rounds: int) -> dict[str, Any]:
    by: dict[str, list[Trial]] = {}
    for t in trials:
        by.setdefault(t.policy, []).append(t)
    policies = {
        name: {
            "median_s": statistics.median(t.seconds for t in ts),
            "min_s": min(t.seconds for t in ts),
            "max_s": max(t.seconds for t in ts),
            "median_tokens_per_s": statistics.median(t.tokens / t.seconds for t in ts if t.seconds),
            "progress_p99_ms": percentile([x for t in ts for x in t.progress_ms], 0.99),
        }
        for name, ts in by.items()
    }
    ratios, best_names = [], []
    for r in range(1, rounds + 1):
        this = {t.policy: t for t in trials if t.round == r}
        statics = {k: v for k, v in this.items() if k.startswith("static:")}
        best = min(statics.values(), key=lambda t: t.seconds)
        ratios.append(this["adaptive"].seconds / best.seconds)
        best_names.append(best.policy)
    adaptive = by["adaptive"]
    return {
        "job": prep.loaded.job.metadata.name,
        "initial_layout": str(prep.layout),
        "rounds": rounds,
        "trials": [t.row() for t in trials],
        "policies": policies,
        "adaptive_over_best_static": {
            "per_round": ratios,
            "median": statistics.median(ratios),
            "best_static_per_round": best_names,
        },
        "switch_overhead": {
            "median_ms": statistics.median(t.switch_ms for t in adaptive),
            "median_share": statistics.median(t.switch_ms / 1e3 / t.seconds for t in adaptive if t.seconds),
        },
        "progress_p99_ms": percentile([x for t in trials for x in t.progress_ms], 0.99),
        "identical_tokens": all(t.identical is not False for t in trials),
        "dtype": prep.loaded.job.spec.model.dtype,
    }


def table(summary: dict[str, Any]) -> list[str]:
    out = [
        f"{'policy':>14}  {'median s':>9}  {'min-max s':>15}  {'tok/s':>7}  {'progress p99':>12}",
    ]
    for name, p in summary["policies"].items():
        out.append(
            f"{name:>14}  {p['median_s']:9.2f}  {p['min_s']:7.2f}-{p['max_s']:<7.2f}  "
            f"{p['median_tokens_per_s']:7.1f}  {p['progress_p99_ms']:9.1f} ms"
        )
    r, sw = summary["adaptive_over_best_static"], summary["switch_overhead"]
    out.append(
        f"adaptive / best static (median of {summary['rounds']} rounds): {r['median']:.3f} "
        f"(per round {', '.join(f'{x:.3f}' for x in r['per_round'])}; best static "
        f"{', '.join(r['best_static_per_round'])})"
    )
    same = "yes" if summary["identical_tokens"] else "NO"
    out.append(
        f"switching: median {sw['median_ms']:.0f} ms per adaptive run ({100 * sw['median_share']:.2f}% of "
        f"it); /v1/progress p99 under load {summary['progress_p99_ms']:.1f} ms; tokens identical across "
        f"trials: {same} ({summary['dtype']})"
    )
    return out
