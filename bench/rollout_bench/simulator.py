"""The simulator against the engine it simulates (``rolloutctl bench simulator``).

For a few small long-tailed workloads, one replica of a model runs each on the real engine (a rank
process, the paged KV pool made tight enough to retract), and the simulator, fed that engine's measured
profile (decode-step latency over batch x context, the prefill rate, the same pool in tokens and pages),
predicts the same run under ``paged`` admission. Reported per workload: retractions and generation seconds,
engine against simulator (medians over runs), and their ratios.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.profile import KVCapacity, Profile
from rollout_profiler.profiling.measure import Echo, profile_measured
from rollout_profiler.sim.config import SimConfig
from rollout_profiler.sim.simulator import Simulator
from rollout_profiler.sim.workloads import Workload
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.engine.driver.launcher import run_task
from rollout_worker.engine.rank.measure import measure_prefill
from rollout_worker.scheduling.layout import Layout

from rollout_bench.record import write_json


@dataclass(frozen=True, slots=True)
class Case:
    """A long-tailed workload: ``requests`` lognormal lengths (median ``median``, at most ``longest``),
    prompts of ``prompt`` tokens, on a pool one page larger than the longest request."""

    seed: int
    requests: int
    prompt: int
    median: float = 60.0
    longest: int = 200

    def lengths(self) -> list[int]:
        rng = np.random.default_rng(self.seed)
        raw = np.round(rng.lognormal(np.log(self.median), 0.9, self.requests))
        return [int(x) for x in np.clip(raw, 2, self.longest)]

    def pool_tokens(self, page: int) -> int:
        return (-(-(self.prompt + max(self.lengths())) // page) + 1) * page

    def specs(self) -> list[RequestSpec]:
        def prompt(i: int) -> tuple[int, ...]:
            return tuple(10 + (i * 7 + j) % 90 for j in range(self.prompt))

        return [
            RequestSpec(f"r{i}", prompt(i), n, Sampling(), ignore_eos=True)
            for i, n in enumerate(self.lengths())
        ]

    def workload(self) -> Workload:
        n = np.array(self.lengths())
        return Workload(f"seed{self.seed}", n, np.full(len(n), self.prompt), n)


CASES = (Case(1, 32, 8), Case(2, 48, 5), Case(3, 40, 12))  # those of tests/profiler/sim/test_paged_agreement


def engine_run(model: Path, case: Case, page: int, max_batch: int, dtype: str) -> dict[str, float]:
    cfg = EngineConfig.load(
        str(model),
        1,
        Layout(1, 1),
        dtype=dtype,
        page_size=page,
        kv_budget_tokens=case.pool_tokens(page),
        max_batch=max_batch,
        prefix_cache=False,
    )
    res = run_batch(cfg, case.specs())
    return {
        "gen_s": res.gen_s,
        "retractions": res.retractions,
        "decode_steps": len(res.step_ms),
        "prefill_steps": len(res.prefill_ms),
        "decode_s": sum(res.step_ms) / 1e3,
        "prefill_s": sum(res.prefill_ms) / 1e3,
    }


def sim_run(profile: Profile, case: Case, page: int, max_batch: int) -> dict[str, float]:
    pool = KVCapacity({1: case.pool_tokens(page)}, {"rule": "the engine's pool"})
    prof = replace(profile, kv_capacity=pool)
    cfg = SimConfig(1, admission="paged", max_batch=max_batch, page_size=page)
    res = Simulator(LatencyModel(prof), case.workload(), cfg).run(Layout(1, 1), name="paged")
    return {"gen_s": res.latency_s, "retractions": res.preemptions}


def measure_profile(model: Path, max_batch: int, longest: int, dtype: str, steps: int, echo: Echo) -> Profile:
    """The replica's decode-step grid up to ``max_batch`` x the longest context, and its prefill rate."""
    batches = sorted({1, 2, 4, 8, max_batch} | {b for b in (12, 16, 24, 32) if b <= max_batch})
    contexts = [8, 32, 64, 128, longest]
    prof = profile_measured(
        "simulator-agreement", "tiny", model, 1, [Layout(1, 1)], batches, contexts, dtype, "cpu", steps, echo
    )
    cfg = EngineConfig.load(str(model), 1, Layout(1, 1), dtype=dtype, max_batch=max_batch)
    rate = run_task(cfg, measure_prefill, {"batch": 8, "context": 64})[0]["tokens_per_ms"]
    return replace(prof, costs=replace(prof.costs, recompute_tokens_per_ms=rate))


def run_agreement_bench(
    model: Path,
    cases: tuple[Case, ...],
    page: int,
    max_batch: int,
    runs: int,
    dtype: str,
    json_out: Path | None,
    echo: Echo,
) -> dict[str, Any]:
    longest = max(c.prompt + max(c.lengths()) for c in cases)
    profile = measure_profile(model, max_batch, longest, dtype, 8, echo)
    rows = []
    for case in cases:
        engine = []
        for i in range(runs):
            engine.append(engine_run(model, case, page, max_batch, dtype))
            echo(
                f"  seed {case.seed} run {i + 1}/{runs}: {engine[-1]['gen_s']:.2f} s, "
                f"{engine[-1]['retractions']} retractions"
            )
        sim = sim_run(profile, case, page, max_batch)
        med = {k: statistics.median(e[k] for e in engine) for k in engine[0]}
        rows.append(
            {
                "case": {"seed": case.seed, "requests": case.requests, "prompt": case.prompt},
                "pool_tokens": case.pool_tokens(page),
                "engine": med,
                "engine_runs": engine,
                "sim": sim,
                "time_ratio": sim["gen_s"] / med["gen_s"],
                "retraction_ratio": sim["retractions"] / med["retractions"] if med["retractions"] else None,
            }
        )
    report = {
        "benchmark": "simulator",
        "model": str(model),
        "dtype": dtype,
        "page_size": page,
        "max_batch": max_batch,
        "runs": runs,
        "profile": {
            "points": len(profile.step_latency),
            "prefill_tokens_per_ms": profile.costs.recompute_tokens_per_ms,
        },
        "rows": rows,
    }
    for line in table(report):
        echo(line)
    if json_out is not None:
        write_json(json_out, report)
    return report


def table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| workload | pool tokens | engine s | sim s | sim / engine | engine retractions | sim retractions "
        "| engine decode / prefill steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        c, e, s = r["case"], r["engine"], r["sim"]
        lines.append(
            f"| seed {c['seed']}: {c['requests']} requests, prompt {c['prompt']} | {r['pool_tokens']} "
            f"| {e['gen_s']:.2f} | {s['gen_s']:.2f} | {r['time_ratio']:.3f} | {e['retractions']:g} "
            f"| {s['retractions']} | {e['decode_steps']:g} / {e['prefill_steps']:g} |"
        )
    return lines
