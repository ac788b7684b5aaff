"""``simulate()``: every policy, oracle and bound on one workload. The entry point above the simulator, the
policies, the oracles and the bounds (which stay free of each other's imports).

Names: ``static:T`` (layout G/T x T throughout, independent replicas), ``adaptive`` (the planner),
``oracle`` (count-balanced: the best chain a policy blind to lengths could run), ``oracle-clairvoyant``
(balanced by true lengths: a labelled bound), ``free-switch`` (zero-cost switches) and ``tail-bound``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.sim.bounds import free_switch_bound, tail_bound
from rollout_profiler.sim.config import SimConfig, SimResult
from rollout_profiler.sim.oracle import oracle
from rollout_profiler.sim.policies import run_adaptive
from rollout_profiler.sim.simulator import Progress, Simulator
from rollout_profiler.sim.workloads import Workload

REFERENCES = ("oracle", "oracle-clairvoyant", "free-switch", "tail-bound")


def default_policies(gpus: int, profiled_tp: Iterable[int]) -> list[str]:
    """``static:T`` for every TP size that divides ``gpus`` and the profile has, then adaptive, the
    count-balanced oracle and the two bounds."""
    have = set(profiled_tp)
    statics = [f"static:{t}" for t in range(1, gpus + 1) if gpus % t == 0 and t in have]
    return [*statics, "adaptive", "oracle", "free-switch", "tail-bound"]


def parse_policies(text: str, gpus: int) -> list[str]:
    out = []
    for i, raw in enumerate(p.strip() for p in text.split(",") if p.strip()):
        if raw == "adaptive" or raw in REFERENCES:
            out.append(raw)
        elif raw.startswith("static:") and raw[7:].isdigit():
            t = int(raw[7:])
            if t < 1 or gpus % t:
                raise UserError(f"item {i + 1}: {raw!r}: TP {t} does not divide {gpus} GPUs", "policies")
            out.append(raw)
        else:
            names = ", ".join(("static:T", "adaptive", *REFERENCES))
            raise UserError(f"item {i + 1}: {raw!r} is not one of {names}", "policies")
    if not out:
        raise UserError("no policy given", "policies")
    return out


def simulate(
    model: LatencyModel,
    workload: Workload,
    cfg: SimConfig,
    policies: list[str],
    progress: Progress | None = None,
    adaptive: Callable[[Simulator], SimResult] = run_adaptive,
) -> dict[str, SimResult]:
    """Run each policy, then the references asked for. The oracles see every policy's result (so they are
    never slower than any), the free-switch bound every result at zero switch cost. ``progress`` hears
    of every run as it goes (:class:`~rollout_profiler.sim.simulator.Progress`); ``adaptive`` runs the
    adaptive policy (the probed run, in ``bench planner``)."""
    sim = Simulator(model, workload, cfg, progress)
    out: dict[str, SimResult] = {}
    for p in policies:
        if p.startswith("static:"):
            out[p] = sim.run(Layout.for_tp(cfg.gpus, int(p[7:])), name=p)
    refs = [p for p in policies if p in REFERENCES and p != "tail-bound"]
    if "adaptive" in policies or refs:
        out["adaptive"] = adaptive(sim)
    ran = list(out.values())
    if refs:
        out["oracle"] = oracle(sim, ran)
    if "oracle-clairvoyant" in policies:
        out["oracle-clairvoyant"] = oracle(sim, [*ran, out["oracle"]], balance="length")
    if "free-switch" in policies:
        chains = [*ran, *(out[k] for k in ("oracle", "oracle-clairvoyant") if k in out)]
        out["free-switch"] = free_switch_bound(sim, chains)
    if "tail-bound" in policies:
        out["tail-bound"] = tail_bound(sim)
    return {p: out[p] for p in policies}
