"""The engine benchmark: decode-step latency by layout x batch x context, and reconfiguration phases.

Each grid point is the median of ``steps`` timed steps; the whole grid is repeated ``runs`` times in
fresh rank processes and the table shows the median over runs with the spread (min-max).
"""

from __future__ import annotations

import itertools
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_worker.api.layout import Layout
from rollout_worker.engine.checkpoint import make_model
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.launcher import run_task
from rollout_worker.engine.measure import measure_grid, measure_reconfig


def ensure_model(preset: str, work: Path, dtype: str = "float32", seed: int = 0) -> Path:
    path = work / f"{preset}-{dtype}-seed{seed}"
    if not (path / "config.json").exists():
        make_model(preset, seed, path, dtype)
    return path


def engine_config(model_dir: Path, ranks: int, dtype: str, device: str) -> EngineConfig:
    return EngineConfig.load(str(model_dir), ranks, dtype=dtype, device=device, collective_timeout_s=300)


def reconfig_pairs(cands: tuple[Layout, ...]) -> list[tuple[str, str]]:
    """Every grow and shrink between neighbouring candidates, plus the extremes."""
    pairs = []
    for a, b in itertools.pairwise(cands):
        pairs += [(str(a), str(b)), (str(b), str(a))]
    if len(cands) > 2:
        pairs += [(str(cands[0]), str(cands[-1])), (str(cands[-1]), str(cands[0]))]
    return pairs


def run_engine_bench(
    preset: str,
    ranks: int,
    batches: list[int],
    contexts: list[int],
    steps: int,
    runs: int,
    dtype: str,
    device: str,
    work: Path,
    json_out: Path | None,
    echo: Callable[[str], Any],
) -> dict[str, Any]:
    model_dir = ensure_model(preset, work, "float32")
    cfg = engine_config(model_dir, ranks, dtype, device)
    grid_args = {
        "layouts": [str(x) for x in cfg.candidates],
        "batches": batches,
        "contexts": contexts,
        "steps": steps,
    }
    rec_args = {
        "pairs": reconfig_pairs(cfg.candidates),
        "methods": ["migrate", "recompute"],
        "batch": min(4, max(batches)),
        "context": max(contexts),
    }
    grid_runs, rec_runs = [], []
    for i in range(runs):
        t0 = time.perf_counter()
        grid_runs.append(run_task(cfg, measure_grid, grid_args)[0]["points"])
        rec_runs.append(run_task(cfg, measure_reconfig, rec_args)[0]["events"])
        echo(f"run {i + 1}/{runs}: {time.perf_counter() - t0:.1f} s")
    grid = _merge_grid(grid_runs)
    report: dict[str, Any] = {
        "preset": preset,
        "ranks": ranks,
        "dtype": dtype,
        "device": device,
        "runs": runs,
        "steps": steps,
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "grid": grid,
        "reconfig": _merge_reconfig(rec_runs),
        "tp_ratios": _ratios(grid),
    }
    _print(report, echo)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1) + "\n")
        echo(f"wrote {json_out}")
    return report


def _merge_grid(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    acc: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for pts in runs:
        for p in pts:
            acc[(p["layout"], p["replicas"], p["tp"], p["batch"], p["context"], p["active"])].append(p["ms"])
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
