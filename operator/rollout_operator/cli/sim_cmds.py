"""`rolloutctl simulate` (one pod, several policies) and `rolloutctl bench planner`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rollout_worker.api.errors import UserError


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
    bench = _bench_group(app)
    bench.command("planner")(bench_planner_cmd)


def _bench_group(app: typer.Typer) -> typer.Typer:
    """The `bench` group another module may have registered already, else a new one."""
    for info in app.registered_groups:
        if info.name == "bench" and info.typer_instance is not None:
            return info.typer_instance
    bench = typer.Typer(help="Benchmarks (JSON output + printed tables).", no_args_is_help=True)
    app.add_typer(bench, name="bench")
    return bench


def simulate_cmd(
    profile: Annotated[
        Path, typer.Option(help="Profile JSON file (e.g. profiles/llama-3.1-8b-h100x8-modelled.json).")
    ],
    gpus: Annotated[int, typer.Option(help="GPUs in the pod.")] = 8,
    workload: Annotated[str, typer.Option(help="deepscaler-8k | deepscaler-16k | a .jsonl of lengths.")] = (
        "deepscaler-8k"
    ),
    policies: Annotated[str, typer.Option(help="Comma list of static:T, adaptive, oracle.")] = (
        "static:1,static:2,static:4,static:8,adaptive,oracle"
    ),
    seed: Annotated[int, typer.Option(help="Seed of a synthetic workload.")] = 0,
    prior: Annotated[
        str, typer.Option(help="Lengths the adaptive predictor starts from: none | previous | a .jsonl.")
    ] = "previous",
    decide_every: Annotated[int, typer.Option(help="Steps between two planner decisions.")] = 32,
    max_batch: Annotated[int, typer.Option(help="Running requests per replica; 0 = unlimited.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of running requests and TP over time.")
    ] = None,
) -> None:
    """Simulate one rollout batch on one pod under each policy; print latency, GPU-busy share, switches.

    `--prior previous` uses the same synthetic workload with seed + 1000 (the previous iteration's lengths).
    """
    from rollout_profiler.planning.latency import LatencyModel
    from rollout_profiler.planning.predictor import Prior
    from rollout_profiler.profile import Profile
    from rollout_profiler.sim.report import plot as plot_results
    from rollout_profiler.sim.report import table
    from rollout_profiler.sim.run import parse_policies, simulate
    from rollout_profiler.sim.simulator import SimConfig
    from rollout_profiler.sim.workloads import RECIPES, load

    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if decide_every < 1:
        raise UserError(f"--decide-every must be >= 1, got {decide_every}")
    if max_batch < 0:
        raise UserError(f"--max-batch must be >= 0, got {max_batch}")
    names = parse_policies(policies, gpus)
    prof = Profile.from_json(profile)
    wl = load(workload, seed)
    if prior == "none":
        pri = None
    elif prior == "previous":
        prev = load(workload, seed + 1000) if workload in RECIPES else None
        pri = Prior.from_samples(prev.lengths, prev.caps) if prev is not None else None
    else:
        prev = load(prior)
        pri = Prior.from_samples(prev.lengths, prev.caps)
    cfg = SimConfig(gpus=gpus, decide_every=decide_every, max_batch_per_replica=max_batch or None, prior=pri)
    results = simulate(LatencyModel(prof), wl, cfg, names)
    if plot is not None:
        plot_results(results, plot, title=f"{wl.name} on {gpus} GPUs, {prof.name}")
    if as_json:
        out: dict[str, Any] = {
            "profile": prof.name,
            "gpus": gpus,
            "workload": wl.summary(),
            "results": {k: r.to_dict() for k, r in results.items()},
        }
        typer.echo(json.dumps(out, indent=1))
    else:
        s = wl.summary()
        typer.echo(
            f"{s['name']}: {s['requests']} requests, mean {s['mean']:.0f} tokens, "
            f"{s['at_cap'] * 100:.1f}% at cap; "
            f"{gpus} GPUs, profile {prof.name} ({prof.method})"
        )
        typer.echo(table(results))
    if plot is not None:
        typer.echo(f"wrote {plot}", err=as_json)


def bench_planner_cmd(
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the results as JSON to this file.")
    ] = None,
    runs: Annotated[int, typer.Option(help="Seeds per workload.")] = 3,
    profile: Annotated[
        Path | None, typer.Option(help="Profile JSON (default: shipped Llama-3.1-8B).")
    ] = None,
) -> None:
    """Static TP 1/2/4/8 vs adaptive vs oracle on deepscaler-8k/16k, and decide() latency."""
    from rollout_profiler.sim import bench as bench_planner

    if runs < 1:
        raise UserError(f"--runs must be >= 1, got {runs}")
    result = bench_planner.run(runs=runs, profile=profile)
    typer.echo(bench_planner.report(result))
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1) + "\n")
        typer.echo(f"wrote {json_out}")
