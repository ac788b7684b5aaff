"""The engine benchmark: decode-step latency by layout x batch x context, and reconfiguration phases.

Each grid point is the median of ``steps`` timed steps; the whole grid is repeated ``runs`` times in
fresh rank processes and the table shows the median over runs with the spread (min-max).
"""

from __future__ import annotations

import itertools
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_worker.config.engine_settings import parse_settings
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.launcher import run_task
from rollout_worker.engine.model.presets import preset_config
from rollout_worker.engine.rank.measure import measure_grid, measure_reconfig
from rollout_worker.scheduling.layout import Layout

from rollout_bench.record import write_json

GRAPH_MODES = (
    "on",
    "off",
    "both",
)  # of each boolean setting compared side by side (cuda_graphs, deterministic, paged_attention)
SIDE_BY_SIDE = ("cuda_graphs", "deterministic", "paged_attention")


def shape_config(
    preset: str, ranks: int, dtype: str, device: str, max_batch: int = 64, **settings: Any
) -> EngineConfig:
    """An engine of a preset's shape with seeded random weights made on the device: a step's latency
    depends on the shape only, and no checkpoint is written (Llama-3.1-8B's would be 32 GB in float32)."""
    model = ModelConfig.from_dict(preset_config(preset), where=f"preset {preset}")
    return EngineConfig(
        model_dir=f"<random {preset}>",
        model=model,
        world=ranks,
        layout=Layout(ranks, 1),
        dtype=dtype,
        engine=parse_settings(
            {
                "device": device,
                "max_batch": max_batch,
                "collective_timeout_seconds": 300,
                **settings,
            }
        ),
        random_weights=True,
    )


def reconfig_pairs(cands: tuple[Layout, ...]) -> list[tuple[str, str]]:
    """Every grow and shrink between neighbouring candidates, plus the extremes."""
    pairs = []
    for a, b in itertools.pairwise(cands):
        pairs += [(str(a), str(b)), (str(b), str(a))]
    if len(cands) > 2:
        pairs += [(str(cands[0]), str(cands[-1])), (str(cands[-1]), str(cands[0]))]
    return pairs


def variants(modes: dict[str, str]) -> list[dict[str, bool]]:
    """The settings each grid runs with: one per setting's value, two (off, on) for the one setting that is
    "both" (at most one is)."""
    for name, mode in modes.items():
        if mode not in GRAPH_MODES:
            raise ValueError(f"{name} must be one of {GRAPH_MODES}, got {mode!r}")
    both = [n for n, m in modes.items() if m == "both"]
    if len(both) > 1:
        raise ValueError(f"only one setting can be compared side by side, got {both}")
    fixed = {n: m == "on" for n, m in modes.items()}
    return [{**fixed, both[0]: v} for v in (False, True)] if both else [fixed]


def run_engine_bench(
    preset: str,
    ranks: int,
    batches: list[int],
    contexts: list[int],
    steps: int,
    runs: int,
    dtype: str,
    device: str,
    json_out: Path | None,
    echo: Callable[[str], Any],
    cuda_graphs: str = "off",
    breakdown: bool = False,
    deterministic: str = "off",
    paged_attention: str = "on",
) -> dict[str, Any]:
    """The grid and the reconfiguration phases, ``runs`` times. ``cuda_graphs``, ``deterministic`` or
    ``paged_attention`` "both" measures every point with the setting off and on in the same run
    (alternating, fresh rank processes each) and reports the ratio."""
    modes = variants(
        {"cuda_graphs": cuda_graphs, "deterministic": deterministic, "paged_attention": paged_attention}
    )
    cfgs = [shape_config(preset, ranks, dtype, device, max(64, *batches), **m) for m in modes]
    cfg = cfgs[0]
    grid_args = {
        "layouts": [str(x) for x in cfg.candidates],
        "batches": batches,
        "contexts": contexts,
        "steps": steps,
        "breakdown": breakdown,
    }
    rec_args = {
        "pairs": reconfig_pairs(cfg.candidates),
        "methods": ["migrate", "recompute"],
        "batch": min(4, max(batches)),
        "context": max(contexts),
    }
    grid_runs: list[list[list[dict[str, Any]]]] = [[] for _ in modes]
    rec_runs, skipped = [], []
    for i in range(runs):
        t0 = time.perf_counter()
        for g, c in enumerate(cfgs):
            res = run_task(c, measure_grid, grid_args)[0]
            grid_runs[g].append(res["points"])
            skipped = res["skipped"]
        if rec_args["pairs"]:
            rec_runs.append(run_task(cfgs[-1], measure_reconfig, rec_args)[0]["events"])
        echo(f"run {i + 1}/{runs}: {time.perf_counter() - t0:.1f} s")
    grids = [_merge_grid(r) for r in grid_runs]
    grid = grids[-1]
    report: dict[str, Any] = {
        "preset": preset,
        "ranks": ranks,
        "dtype": dtype,
        "device": device,
        "device_name": _device_name(device),
        "cuda_graphs": cuda_graphs,
        "deterministic": deterministic,
        "paged_attention": paged_attention,
        "runs": runs,
        "steps": steps,
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "grid": grid,
        "skipped": skipped,
        "reconfig": _merge_reconfig(rec_runs),
        "tp_ratios": _ratios(grid),
    }
    if cuda_graphs == "both":
        report["grid_eager"] = grids[0]
        report["graph_ratios"] = _side_ratios(grids[0], grids[1], ("eager", "graphs"))
    if deterministic == "both":
        report["grid_default"] = grids[0]
        report["deterministic_cost"] = _deterministic_cost(grids[0], grids[1])
    if paged_attention == "both":
        report["grid_gather"] = grids[0]
        report["paged_ratios"] = _side_ratios(grids[0], grids[1], ("gather", "paged"))
    _print(report, echo)
    if json_out is not None:
        write_json(json_out, report)
        echo(f"wrote {json_out}")
    return report


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return str(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cuda (none visible)"
    return platform.processor() or platform.machine()


_POINT = ("layout", "batch", "context", "active")


def _pairs(
    off: list[dict[str, Any]], on: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The points measured both with a setting off and on (median over runs of each)."""
    by = {tuple(p[k] for k in _POINT): p for p in off}
    return [(by[key], p) for p in on if (key := tuple(p[k] for k in _POINT)) in by]


def _side_ratios(
    off: list[dict[str, Any]], on: list[dict[str, Any]], names: tuple[str, str]
) -> list[dict[str, Any]]:
    """A setting off over on, step time, at each point both measured: ``<name>_ms`` and ``<name>_breakdown``
    for each side's ``names`` (eager and graphs; gather and paged), and the speed-up."""
    a, b = names
    return [
        {
            **{k: p[k] for k in _POINT},
            f"{a}_ms": e["ms"],
            f"{b}_ms": p["ms"],
            "speedup": e["ms"] / p["ms"],
            f"{a}_breakdown": e.get("breakdown"),
            f"{b}_breakdown": p.get("breakdown"),
        }
        for e, p in _pairs(off, on)
    ]


def _deterministic_cost(default: list[dict[str, Any]], det: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decode tokens/s with the deterministic kernels over the default's, at each point both measured (the
    tokens of a step: its batch, or one for an ``active: one`` point's lone replica)."""
    return [
        {
            **{k: p[k] for k in _POINT},
            "default_ms": d["ms"],
            "deterministic_ms": p["ms"],
            "tokens_per_s_ratio": d["ms"] / p["ms"],
        }
        for d, p in _pairs(default, det)
    ]


def _merge_grid(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    acc: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    breakdowns: dict[tuple[Any, ...], dict[str, float]] = {}
    for pts in runs:
        for p in pts:
            k = (p["layout"], p["replicas"], p["tp"], p["batch"], p["context"], p["active"])
            acc[k].append(p["ms"])
            if "breakdown" in p:
                breakdowns[k] = p["breakdown"]  # the last run's
    return [
        {
            "layout": k[0],
            "replicas": k[1],
            "tp": k[2],
            "batch": k[3],
            "context": k[4],
            "active": k[5],
            "ms": statistics.median(v),
            "ms_min": min(v),
            "ms_max": max(v),
            "runs": v,
            **({"breakdown": breakdowns[k]} if k in breakdowns else {}),
        }
        for k, v in acc.items()
    ]


def _merge_reconfig(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    acc: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for evs in runs:
        for ev in evs:
            acc[(ev["src"], ev["dst"], ev["method"])].append(ev)
    out = []
    for (src, dst, method), evs in acc.items():
        phases = {k: statistics.median(e["phases"].get(k, 0.0) for e in evs) for k in evs[0]["phases"]}
        out.append(
            {
                "from": src,
                "to": dst,
                "method": method,
                "tokens": evs[0]["tokens"],
                "kv_bytes_moved": evs[0].get("kv_bytes_moved", 0),
                "weight_bytes_received": evs[0]["weights"].get("bytes_received", 0),
                "phases_ms": phases,
                "total_ms_runs": [e["phases"]["total_ms"] for e in evs],
            }
        )
    return out


def _ratios(grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step latency of each TP>1 replica relative to one lone TP=1 replica, same batch and context."""
    solo = {
        (p["batch"], p["context"]): p["ms"]
        for p in grid
        if p["tp"] == 1 and (p["active"] == "one" or p["replicas"] == 1)
    }
    out = []
    for p in grid:
        base = solo.get((p["batch"], p["context"]))
        if p["tp"] > 1 and base:
            out.append(
                {
                    "tp": p["tp"],
                    "batch": p["batch"],
                    "context": p["context"],
                    "tp1_ms": base,
                    "tp_ms": p["ms"],
                    "speedup": base / p["ms"],
                }
            )
    return out


def _print(report: dict[str, Any], echo: Callable[[str], Any]) -> None:
    echo(
        f"\nengine benchmark: preset {report['preset']}, {report['ranks']} ranks, {report['dtype']}, "
        f"{report['device']}, median of {report['runs']} runs x {report['steps']} steps"
    )
    echo(f"{'layout':>7} {'active':>6} {'batch':>5} {'context':>7} {'step ms':>9} {'min':>8} {'max':>8}")
    for p in report["grid"]:
        echo(
            f"{p['layout']:>7} {p['active']:>6} {p['batch']:>5} {p['context']:>7} {p['ms']:>9.2f} "
            f"{p['ms_min']:>8.2f} {p['ms_max']:>8.2f}"
        )
    for s in report["skipped"]:
        echo(f"{s['layout']:>7} {'':>6} {s['batch']:>5} {s['context']:>7}  skipped: {s['why']}")
    if report.get("graph_ratios"):
        echo(
            "\neager vs CUDA graphs (median step ms; where the step's time goes, from the last run's"
            " profile):"
        )
        _print_sides(report["graph_ratios"], ("eager", "graphs"), echo)
    if report.get("paged_ratios"):
        echo("\nkeys gathered vs pages read in place (median step ms; where the step's time goes):")
        _print_sides(report["paged_ratios"], ("gather", "paged"), echo)
    if report.get("deterministic_cost"):
        _print_cost(report["deterministic_cost"], echo)
    echo("\nTP speed-up over one lone TP=1 replica (same batch, context):")
    for r in report["tp_ratios"]:
        echo(
            f"  TP={r['tp']} batch {r['batch']:>3} context {r['context']:>5}: {r['tp1_ms']:.2f} ms -> "
            f"{r['tp_ms']:.2f} ms  ({r['speedup']:.2f}x)"
        )
    echo("\nreconfiguration phases (median ms):")
    echo(
        f"{'from':>5} {'to':>5} {'method':>9} {'tokens':>7} {'KV MB':>7} {'W MB':>7} {'sync':>7}"
        f" {'reshard':>8} {'kv':>8} {'total':>8}"
    )
    for r in report["reconfig"]:
        ph = r["phases_ms"]
        kv = ph.get("kv_migrate_ms", ph.get("kv_recompute_ms", 0.0))
        echo(
            f"{r['from']:>5} {r['to']:>5} {r['method']:>9} {r['tokens']:>7} "
            f"{r['kv_bytes_moved'] / 1e6:>7.2f} "
            f"{r['weight_bytes_received'] / 1e6:>7.2f} {ph['sync_ms']:>7.2f} {ph['reshard_ms']:>8.2f} "
            f"{kv:>8.2f} {ph['total_ms']:>8.2f}"
        )


def _print_cost(rows: list[dict[str, Any]], echo: Callable[[str], Any]) -> None:
    echo("\ndeterministic kernels vs default (median step ms; tokens/s of deterministic / default):")
    echo(
        f"{'layout':>7} {'active':>6} {'batch':>5} {'context':>7} {'default':>8} {'determ.':>8} {'tok/s':>6}"
    )
    for r in rows:
        echo(
            f"{r['layout']:>7} {r['active']:>6} {r['batch']:>5} {r['context']:>7} {r['default_ms']:>8.2f}"
            f" {r['deterministic_ms']:>8.2f} {r['tokens_per_s_ratio']:>6.3f}"
        )


def _print_sides(rows: list[dict[str, Any]], names: tuple[str, str], echo: Callable[[str], Any]) -> None:
    a, b = names
    echo(
        f"{'layout':>7} {'active':>6} {'batch':>5} {'context':>7} {a:>8} {b:>8} {'speedup':>7}"
        f" | {a + ': kernels':>15} {'idle':>6} {'launches':>8} | {b + ': kernels':>15} {'idle':>6}"
    )
    for r in rows:
        eb, gb = r.get(f"{a}_breakdown") or {}, r.get(f"{b}_breakdown") or {}
        echo(
            f"{r['layout']:>7} {r['active']:>6} {r['batch']:>5} {r['context']:>7} {r[f'{a}_ms']:>8.2f}"
            f" {r[f'{b}_ms']:>8.2f}"
            f" {r['speedup']:>6.2f}x | {eb.get('gpu_kernels_ms', float('nan')):>15.2f}"
            f" {eb.get('gpu_idle_ms', float('nan')):>6.2f} {eb.get('launches_per_step', float('nan')):>8.0f}"
            f" | {gb.get('gpu_kernels_ms', float('nan')):>15.2f} {gb.get('gpu_idle_ms', float('nan')):>6.2f}"
        )
