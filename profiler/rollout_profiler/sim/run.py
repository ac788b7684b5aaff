"""``simulate()``: every policy on one workload, the entry point above the simulator and the oracle (which
both stay free of each other's imports)."""

from __future__ import annotations

from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.sim.oracle import oracle
from rollout_profiler.sim.simulator import SimConfig, SimResult, Simulator, run_adaptive
from rollout_profiler.sim.workloads import Workload


def parse_policies(text: str, gpus: int) -> list[str]:
    out = []
    for i, raw in enumerate(p.strip() for p in text.split(",") if p.strip()):
        if raw in ("adaptive", "oracle"):
            out.append(raw)
        elif raw.startswith("static:") and raw[7:].isdigit():
            t = int(raw[7:])
            if t < 1 or gpus % t:
                raise UserError(f"--policies item {i + 1}: {raw!r}: TP {t} does not divide {gpus} GPUs")
            out.append(raw)
        else:
            raise UserError(f"--policies item {i + 1}: {raw!r} is not static:T, adaptive or oracle")
    if not out:
        raise UserError("--policies: no policy given")
    return out


def simulate(
    model: LatencyModel, workload: Workload, cfg: SimConfig, policies: list[str]
) -> dict[str, SimResult]:
    """Run each policy; the oracle also sees every other result, so it is never slower than any of them."""
    sim = Simulator(model, workload, cfg)
    out: dict[str, SimResult] = {}
    statics: dict[Layout, SimResult] = {}
    for p in policies:
        if p.startswith("static:"):
            lay = Layout.for_tp(cfg.gpus, int(p[7:]))
            out[p] = statics[lay] = sim.run(lay, name=p)
    want_adaptive = "adaptive" in policies or "oracle" in policies
    if want_adaptive:
        out["adaptive"] = run_adaptive(sim)
    if "oracle" in policies:
        out["oracle"] = oracle(sim, [*out.values()])
    if "adaptive" not in policies:
        out.pop("adaptive", None)
    return {p: out[p] for p in policies}
