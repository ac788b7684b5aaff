"""The planner benchmark (``rolloutctl bench planner``): how much adaptive TP saves, against what.

For each profile (default: the modelled H100 profiles of Llama-3.1-8B and Qwen3-14B, built in code:
identical to the shipped files) and each workload (default: every named one; or JSONL files of real
lengths), on a pod of 8 GPUs, over ``runs`` seeds: generation seconds of static TP 1/2/4/8 (independent
replicas), adaptive (the predictor + planner; its prior is the previous iteration, i.e. the same workload
with seed + 1000; no prior for a JSONL file), the count-balanced oracle, the clairvoyant oracle (labelled
bound), the free-switch bound and the tail bound (:mod:`rollout_profiler.sim.bounds`); the ratios adaptive /
static TP1, / best static, / oracle, / free-switch; and the break-even switch cost: the largest cost per
switch at which any chain found (adaptive's, the oracles', the free-switch one) would still beat the best
static layout, beside what a switch costs in the profile. Every figure says which admission policy it
used. Decision latency: p50/p99 of the planner's ``decide()`` for 8 ranks and 1,024 running requests, with
the memory model in, and of the predictor fit that precedes it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import decide
from rollout_profiler.planning.policy import PlannerPolicy, PodSnapshot, ReplicaState
from rollout_profiler.planning.predictor import Prior, fit
from rollout_profiler.planning.speculation import Speculation, SpeculativeLatency
from rollout_profiler.profile import Profile
from rollout_profiler.profiling.modelled import SHIPPED, build
from rollout_profiler.sim.config import SimConfig, SimResult
from rollout_profiler.sim.probe import Probe, median_abs_error, probed_adaptive
from rollout_profiler.sim.simulate import simulate
from rollout_profiler.sim.simulator import Simulator
from rollout_profiler.sim.workloads import RECIPES, load, synthetic
from rollout_worker.scheduling.layout import Layout

GPUS = 8
PROBES = (0.25, 0.5, 0.75)  # adaptive's prediction of its time to finish, checked at these shares of a run
STATICS = ("static:1", "static:2", "static:4", "static:8")
POLICIES = (*STATICS, "adaptive", "oracle", "oracle-clairvoyant", "free-switch", "tail-bound")
WORKLOADS = tuple(RECIPES)


def default_profiles() -> list[Profile]:
    """The modelled H100 profiles of Llama-3.1-8B and Qwen3-14B (the shipped files, built in code)."""
    return [build(shape, name) for shape, name in SHIPPED.values()]


def _break_even_ms(res: dict[str, SimResult], best_static_s: float) -> float:
    """Largest cost per switch at which a chain found still beats the best static layout (0: none does)."""
    out = 0.0
    for key in ("adaptive", "oracle", "oracle-clairvoyant", "free-switch"):
        r = res[key]
        if r.reconfigs:
            free = r.latency_s - r.switch_ms / 1e3
            out = max(out, (best_static_s - free) * 1e3 / len(r.reconfigs))
    return out


class _Probed:
    """The adaptive runner ``bench planner`` gives ``simulate``: the probed run, its probes kept."""

    def __init__(self) -> None:
        self.probes: list[Probe] = []

    def __call__(self, sim: Simulator) -> SimResult:
        res, self.probes = probed_adaptive(sim, PROBES)
        return res


def _quiet(_: str) -> None:
    pass


def bench_workload(
    model: LatencyModel, spec: str, runs: int, admission: str, say: Callable[[str], None] = _quiet
) -> dict[str, Any]:
    per: dict[str, list[float]] = {p: [] for p in POLICIES}
    switches: dict[str, list[int]] = {p: [] for p in POLICIES}
    break_even, switch_cost, preempt, summary = [], [], [], {}
    errors: list[float | None] = []
    named = spec in RECIPES
    for seed in range(runs if named else 1):
        wl = load(spec, seed)
        summary = wl.summary()
        prior = None
        if named:
            prev = synthetic(spec, seed + 1000)
            prior = Prior.from_samples(prev.lengths, prev.caps)
        t0 = time.perf_counter()
        cfg = SimConfig(GPUS, admission=admission, prior=prior)
        probed = _Probed()  # the adaptive run is the probed one (probes change nothing)
        res = simulate(model, wl, cfg, list(POLICIES), adaptive=probed)
        say(
            f"{model.profile.name} {spec} seed {seed}: adaptive {res['adaptive'].latency_s:.1f} s "
            f"(simulated in {time.perf_counter() - t0:.0f} s)"
        )
        errors.append(median_abs_error(probed.probes))
        for p, r in res.items():
            per[p].append(r.latency_s)
            switches[p].append(len(r.reconfigs))
        best = min(res[s].latency_s for s in STATICS)
        break_even.append(_break_even_ms(res, best))
        switch_cost += [e.predicted_ms for e in res["adaptive"].reconfigs]
        preempt.append(sum(res[p].preemptions for p in STATICS) / len(STATICS))
    mean = {k: statistics.fmean(v) for k, v in per.items()}
    best_static = min(STATICS, key=lambda s: mean[s])
    a = mean["adaptive"]
    return {
        "workload": spec,
        "summary": summary,
        "runs": len(per["adaptive"]),
        "admission": admission,
        "latency_s": mean,
        "latency_s_per_seed": per,
        "switches_mean": {k: statistics.fmean(v) for k, v in switches.items()},
        "best_static": best_static,
        "adaptive_vs_static_tp1": a / mean["static:1"],
        "adaptive_vs_best_static": a / mean[best_static],
        "adaptive_vs_oracle": a / mean["oracle"],
        "adaptive_vs_free_switch": a / mean["free-switch"],
        "break_even_switch_ms": statistics.fmean(break_even),
        "adaptive_switch_ms_mean": statistics.fmean(switch_cost) if switch_cost else None,
        "static_preemptions_mean": statistics.fmean(preempt),
        "prediction_error_median": statistics.fmean(e for e in errors if e is not None)
        if any(e is not None for e in errors)
        else None,
    }


def bench_speculation(
    profile: Profile,
    plain: dict[str, Any],
    spec: Speculation,
    runs: int,
    admission: str,
    say: Callable[[str], None] = _quiet,
) -> dict[str, Any]:
    """The static layouts and adaptive again, every replica speculating (:class:`SpeculativeLatency`, the
    ``auto`` policy's choice per step at acceptance ``spec.accept``), beside ``plain`` (this workload's
    :func:`bench_workload`): where layout and speculation together beat the best of either alone."""
    name = plain["workload"]
    model = SpeculativeLatency(profile, spec)
    per: dict[str, list[float]] = {p: [] for p in (*STATICS, "adaptive")}
    switches: list[int] = []
    for seed in range(plain["runs"]):
        prev = synthetic(name, seed + 1000) if name in RECIPES else None
        prior = Prior.from_samples(prev.lengths, prev.caps) if prev is not None else None
        res = simulate(model, load(name, seed), SimConfig(GPUS, admission=admission, prior=prior), list(per))
        say(f"{profile.name} {name} seed {seed}, speculating: adaptive {res['adaptive'].latency_s:.1f} s")
        for p, r in res.items():
            per[p].append(r.latency_s)
        switches.append(len(res["adaptive"].reconfigs))
    mean = {k: statistics.fmean(v) for k, v in per.items()}
    best_static = min(STATICS, key=lambda s: mean[s])
    plain_best = min(plain["latency_s"][plain["best_static"]], plain["latency_s"]["adaptive"])
    alone = min(mean[best_static], plain_best)  # speculation alone (best static layout), or layouts alone
    a = mean["adaptive"]
    return {
        "accept": spec.accept,
        "draft_tokens": spec.draft_tokens,
        "tokens_per_verify": spec.tokens(spec.draft_tokens),
        "latency_s": mean,
        "switches_mean": statistics.fmean(switches),
        "best_static": best_static,
        "vs_plain_adaptive": a / plain["latency_s"]["adaptive"],
        "vs_best_static_speculating": a / mean[best_static],
        "vs_best_alone": a / alone,
    }


def _snapshot(mixed: bool, n: int = 1024, seed: int = 0) -> PodSnapshot:
    rng = np.random.default_rng(seed)
    gen = rng.integers(0, 4000, n) if mixed else np.full(n, 1000)
    per = np.array_split(np.arange(n), GPUS)
    prompt = rng.integers(100, 600, n)
    cap = np.full(n, 8192)
    reps = tuple(ReplicaState(prompt[ix], gen[ix], cap[ix]) for ix in per)
    return PodSnapshot(Layout(GPUS, 1), reps, (True,) * GPUS, step=1000, time_s=12.0)


def bench_decide(model: LatencyModel, admission: str, calls: int = 2000) -> dict[str, Any]:
    """decide() on 8 ranks (8x1) with 1,024 running requests, memory model in (the profile's KV capacity)."""
    prev = synthetic("deepscaler-8k", 1000)
    prior = Prior.from_samples(prev.lengths, prev.caps)
    prof = model.profile
    tokens = tuple(sorted(prof.kv_capacity.tokens_per_replica.items())) if prof.kv_capacity else ()
    policy = PlannerPolicy(
        tuple(Layout.for_tp(GPUS, t) for t in (1, 2, 4, 8)), kv_tokens_per_replica=tokens, admission=admission
    )
    out: dict[str, Any] = {"memory_model": bool(tokens), "admission": admission}
    for label, mixed in (("synchronous", False), ("mixed", True)):
        snap = _snapshot(mixed)
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


def run(
    profiles: list[Profile] | None = None,
    workloads: tuple[str, ...] | list[str] = WORKLOADS,
    runs: int = 3,
    admission: str = "paged",
    decide_calls: int = 2000,
    say: Callable[[str], None] = _quiet,
    speculation: Speculation | None = None,
) -> dict[str, Any]:
    """``say``: a line per simulated batch (model, workload, seed), as progress. With ``speculation``, each
    workload also runs speculating (:func:`bench_speculation`)."""
    models = []
    for prof in profiles or default_profiles():
        model = LatencyModel(prof)
        done = [bench_workload(model, w, runs, admission, say) for w in workloads]
        if speculation is not None:
            for w in done:
                w["speculation"] = bench_speculation(prof, w, speculation, runs, admission, say)
        models.append(
            {
                "profile": prof.name,
                "model": prof.model.name,
                "profile_method": prof.method,
                "device": f"{prof.device_count} x {prof.device_name}",
                "gpus": GPUS,
                "admission": admission,
                "kv_capacity": prof.kv_capacity.to_dict() if prof.kv_capacity else None,
                "workloads": done,
                "decide": bench_decide(model, admission, decide_calls),
            }
        )
    out: dict[str, Any] = {"models": models}
    out["aims"] = aims(out)
    return out


_RATIO_AIMS = (
    ("adaptive_vs_oracle", "adaptive within 1.5% of the count-balanced oracle", 1.015),
    ("adaptive_vs_free_switch", "adaptive within 3% of the free-switch bound", 1.03),
    ("adaptive_vs_best_static", "adaptive never slower than the best static layout", 1.0),
)
MAX_SWITCHES_16K = 2.0  # DeepScaleR-16k: at most two switches a batch (no flapping)


def _aim(model: str, aim: str, met: bool, numbers: str) -> dict[str, Any]:
    return {"model": model, "aim": aim, "met": met, "worst": numbers}


def aims(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Each aim of the benchmark, met or not, with the numbers (the worst workload for ratio aims)."""
    rows = []
    for m in d["models"]:
        ws, name = m["workloads"], m["model"]
        for key, label, limit in _RATIO_AIMS:
            worst = ws[int(np.argmax([w[key] for w in ws]))]
            rows.append(_aim(name, label, worst[key] <= limit, f"{worst['workload']}: {worst[key]:.3f}"))
        for w in ws:
            if w["workload"] == "deepscaler-16k":
                n = w["switches_mean"]["adaptive"]
                label = "at most two switches a batch on deepscaler-16k"
                rows.append(_aim(name, label, n <= MAX_SWITCHES_16K, f"{n:.1f} a batch"))
            if w["workload"] == "sparse-tail":
                saved = 1 - w["adaptive_vs_static_tp1"]
                label = "at least 35% below static TP1 on sparse-tail"
                rows.append(_aim(name, label, saved >= 0.35, f"{saved * 100:.1f}% below"))
        p99 = max(m["decide"][k]["decide_ms_p99"] for k in ("synchronous", "mixed"))
        rows.append(
            _aim(name, "decision p99 under 1 ms with the memory model in", p99 < 1.0, f"p99 {p99:.3f} ms")
        )
    return rows


COLUMNS = (("TP1", "static:1"), ("TP2", "static:2"), ("TP4", "static:4"), ("TP8", "static:8"),
         ("adaptive", "adaptive"), ("oracle", "oracle"), ("clairv.", "oracle-clairvoyant"),
         ("free-sw", "free-switch"), ("tail", "tail-bound"))  # fmt: skip
RATIO_COLUMNS = (("a/TP1", "adaptive_vs_static_tp1"), ("a/best", "adaptive_vs_best_static"),
           ("a/oracle", "adaptive_vs_oracle"), ("a/free", "adaptive_vs_free_switch"))  # fmt: skip


def report(d: dict[str, Any]) -> str:
    lines = []
    for m in d["models"]:
        runs = max(w["runs"] for w in m["workloads"])
        lines.append(
            f"{m['model']} ({m['profile']}, {m['profile_method']}), {m['gpus']} GPUs, "
            f"admission {m['admission']}, mean of {runs} seed(s): generation seconds"
        )
        head = (
            f"{'workload':<19}"
            + "".join(f"{c:>9}" for c, _ in COLUMNS)
            + "".join(f"{c:>9}" for c, _ in RATIO_COLUMNS)
        )
        lines.append(head + f"{'best':>6}{'break-even':>12}{'switch':>8}")
        for w in m["workloads"]:
            cells = "".join(f"{w['latency_s'][k]:>9.2f}" for _, k in COLUMNS)
            ratios = "".join(f"{w[k]:>9.3f}" for _, k in RATIO_COLUMNS)
            sw = w["adaptive_switch_ms_mean"]
            best = "TP" + w["best_static"].split(":")[1]
            lines.append(
                f"{w['workload'][:19]:<19}{cells}{ratios}{best:>6}{w['break_even_switch_ms']:>10.0f}ms"
                f"{'-' if sw is None else f'{sw:.0f}ms':>8}"
            )
        specs = [w for w in m["workloads"] if "speculation" in w]
        if specs:
            sp = specs[0]["speculation"]
            lines.append(
                f"speculating (accept {sp['accept']:g}, {sp['draft_tokens']} draft tokens: "
                f"{sp['tokens_per_verify']:.2f} tokens a full verify):"
            )
            heads = ("best st.", "adaptive", "a+s", "/plain a", "/best s", "/alone")
            lines.append(f"{'workload':<19}" + "".join(f"{c:>9}" for c in heads))
            for w in specs:
                x = w["speculation"]
                lines.append(
                    f"{w['workload'][:19]:<19}{x['latency_s'][x['best_static']]:>9.2f}"
                    f"{w['latency_s']['adaptive']:>9.2f}{x['latency_s']['adaptive']:>9.2f}"
                    f"{x['vs_plain_adaptive']:>9.3f}{x['vs_best_static_speculating']:>9.3f}{x['vs_best_alone']:>9.3f}"
                )
        for label in ("synchronous", "mixed"):
            x = m["decide"][label]
            lines.append(
                f"decide() 8 ranks, 1,024 running ({label}, memory model in): "
                f"p50 {x['decide_ms_p50']:.3f} ms, p99 {x['decide_ms_p99']:.3f} ms; "
                f"predictor fit p50 {x['fit_ms_p50']:.3f} ms, "
                f"p99 {x['fit_ms_p99']:.3f} ms"
            )
        lines.append("")
    lines.append("aims:")
    for a in d["aims"]:
        lines.append(f"  {'met    ' if a['met'] else 'NOT MET'}  {a['model']}: {a['aim']} ({a['worst']})")
    return "\n".join(lines)


def load_profiles(paths: list[Path]) -> list[Profile] | None:
    return [Profile.from_json(p) for p in paths] if paths else None
