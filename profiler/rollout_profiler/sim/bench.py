"""Planner benchmark: generation latency of static TP, adaptive and oracle, and decide() latency.

For each workload (deepscaler-8k, deepscaler-16k) and ``runs`` seeds, on a pod of 8 GPUs with the modelled
Llama-3.1-8B profile: static TP 1/2/4/8, adaptive (predictor + planner; prior = the lengths of the previous
iteration, i.e. the same workload with seed + 1000), adaptive without a prior, the oracle (knows every
length: best chain of switches, requests placed by true length) and the count-balanced oracle (best chain
when requests can only be dealt by count, as for any policy blind to lengths). Latencies
are means over seeds. Decision latency: p50/p99 of ``decide()`` on an 8-rank pod with 1,024 running
requests (synchronous: all generated 1,000 tokens; and mixed: generated spread over 0..4,000), and of
the predictor fit that precedes it. Run: ``python bench/planner.py [--json OUT] [--runs N]`` or
``rolloutctl bench planner``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from rollout_worker.api.layout import Layout

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import PlannerPolicy, PodSnapshot, ReplicaState, decide
from rollout_profiler.planning.predictor import Prior, fit
from rollout_profiler.profile import Profile
from rollout_profiler.profiling.modelled import LLAMA_31_8B, build
from rollout_profiler.sim.oracle import oracle
from rollout_profiler.sim.run import simulate
from rollout_profiler.sim.simulator import SimConfig, Simulator, run_adaptive
from rollout_profiler.sim.workloads import synthetic

WORKLOADS = ("deepscaler-8k", "deepscaler-16k")
STATICS = ("static:1", "static:2", "static:4", "static:8")


def load_profile(path: str | Path | None = None) -> Profile:
    """The profile at ``path``; by default the modelled Llama-3.1-8B profile, built in code (the shipped
    ``profiles/llama-3.1-8b-h100x8-modelled.json`` is this same profile, so an installed package needs no
    checkout)."""
    if path is None:
        return build(LLAMA_31_8B, "llama-3.1-8b-h100x8-modelled")
    return Profile.from_json(path)


def bench_workload(model: LatencyModel, name: str, runs: int, gpus: int = 8) -> dict[str, Any]:
    per: dict[str, list[float]] = {}
    switches: dict[str, list[int]] = {}
    for seed in range(runs):
        wl = synthetic(name, seed)
        prev = synthetic(name, seed + 1000)
        cfg = SimConfig(gpus=gpus, prior=Prior.from_samples(prev.lengths, prev.caps))
        res = simulate(model, wl, cfg, [*STATICS, "adaptive", "oracle"])
        others = [r for k, r in res.items() if k != "oracle"]
        res["oracle (count-balanced)"] = oracle(Simulator(model, wl, cfg), others, balance="count")
        res["adaptive (no prior)"] = run_adaptive(Simulator(model, wl, SimConfig(gpus=gpus)))
        for k, r in res.items():
            per.setdefault(k, []).append(r.latency_s)
            switches.setdefault(k, []).append(len(r.reconfigs))
    mean = {k: statistics.fmean(v) for k, v in per.items()}
    best_static = min(STATICS, key=lambda s: mean[s])
    return {
        "workload": name,
        "runs": runs,
        "latency_s": mean,
        "latency_s_per_seed": per,
        "switches_mean": {k: statistics.fmean(v) for k, v in switches.items()},
        "best_static": best_static,
        "adaptive_vs_best_static": mean["adaptive"] / mean[best_static] - 1,
        "adaptive_no_prior_vs_best_static": mean["adaptive (no prior)"] / mean[best_static] - 1,
        "oracle_vs_best_static": mean["oracle"] / mean[best_static] - 1,
        "adaptive_gap_to_oracle": mean["adaptive"] / mean["oracle"] - 1,
        "adaptive_gap_to_count_oracle": mean["adaptive"] / mean["oracle (count-balanced)"] - 1,
    }


def _snapshot(mixed: bool, gpus: int = 8, n: int = 1024, seed: int = 0) -> PodSnapshot:
    rng = np.random.default_rng(seed)
    gen = rng.integers(0, 4000, n) if mixed else np.full(n, 1000)
    per = np.array_split(np.arange(n), gpus)
    prompt = rng.integers(100, 600, n)
    cap = np.full(n, 8192)
    reps = tuple(ReplicaState(prompt[ix], gen[ix], cap[ix]) for ix in per)
    return PodSnapshot(Layout(gpus, 1), reps, (True,) * gpus, step=1000, time_s=12.0)


def bench_decide(model: LatencyModel, calls: int = 2000, gpus: int = 8) -> dict[str, Any]:
    prev = synthetic("deepscaler-8k", 1000)
    prior = Prior.from_samples(prev.lengths, prev.caps)
    policy = PlannerPolicy(tuple(Layout.for_tp(gpus, t) for t in (1, 2, 4, 8)))
    out: dict[str, Any] = {}
    for label, mixed in (("synchronous", False), ("mixed", True)):
        snap = _snapshot(mixed, gpus)
        gen = np.concatenate([r.generated for r in snap.replicas])
        caps = np.concatenate([r.cap for r in snap.replicas])
        fin = synthetic("deepscaler-8k", 7).lengths[:200]
        t_fit, t_dec = [], []
        pred = fit(fin, gen, caps, np.full(fin.shape, 8192), prior)
        for i in range(calls):
            t0 = time.perf_counter()
            if i % 10 == 0:
                pred = fit(fin, gen, caps, np.full(fin.shape, 8192), prior)
                t_fit.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            decide(model, snap, policy, pred)
            t_dec.append(time.perf_counter() - t0)
        out[label] = {
            "decide_ms_p50": float(np.percentile(t_dec, 50) * 1e3),
            "decide_ms_p99": float(np.percentile(t_dec, 99) * 1e3),
            "fit_ms_p50": float(np.percentile(t_fit, 50) * 1e3),
            "fit_ms_p99": float(np.percentile(t_fit, 99) * 1e3),
            "calls": calls,
        }
    return out


def run(runs: int = 3, profile: str | Path | None = None, decide_calls: int = 2000) -> dict[str, Any]:
    prof = load_profile(profile)
    model = LatencyModel(prof)
    return {
        "profile": prof.name,
        "profile_method": prof.method,
        "gpus": 8,
        "workloads": [bench_workload(model, w, runs) for w in WORKLOADS],
        "decide": bench_decide(model, calls=decide_calls),
    }


def report(d: dict[str, Any]) -> str:
    cols = [*STATICS, "adaptive", "adaptive (no prior)", "oracle (count-balanced)", "oracle"]
    head = f"profile {d['profile']} ({d['profile_method']}), {d['gpus']} GPUs"
    lines = [f"{head}; generation latency, s (mean over seeds)"]
    lines.append(f"{'workload':<16}" + "".join(f"{c.replace(' (', '('):>{max(10, len(c))}} " for c in cols))
    for w in d["workloads"]:
        cells = "".join(f"{w['latency_s'][c]:>{max(10, len(c))}.2f} " for c in cols)
        lines.append(f"{w['workload']:<16}{cells}")
    lines.append("")
    for w in d["workloads"]:
        lines.append(
            f"{w['workload']} ({w['runs']} seeds): best static {w['best_static']}; adaptive "
            f"{w['adaptive_vs_best_static'] * 100:+.1f}% vs best static (no prior "
            f"{w['adaptive_no_prior_vs_best_static'] * 100:+.1f}%), oracle "
            f"{w['oracle_vs_best_static'] * 100:+.1f}%; adaptive is {w['adaptive_gap_to_oracle'] * 100:.1f}% "
            f"above oracle, {w['adaptive_gap_to_count_oracle'] * 100:.1f}% above the count-balanced oracle; "
            f"switches adaptive {w['switches_mean']['adaptive']:.1f}, "
            f"oracle {w['switches_mean']['oracle']:.1f}"
        )
    for label, x in d["decide"].items():
        lines.append(
            f"decide() 8 ranks, 1,024 running ({label}): p50 {x['decide_ms_p50']:.3f} ms, "
            f"p99 {x['decide_ms_p99']:.3f} ms; predictor fit p50 {x['fit_ms_p50']:.3f} ms, "
            f"p99 {x['fit_ms_p99']:.3f} ms"
        )
    return "\n".join(lines)
