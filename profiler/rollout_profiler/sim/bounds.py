"""The two references reported beside the policies.

* Tail bound (a proof, not an estimate): the longest response needs as many decode steps as its length,
  and no step of any replica is faster than the best batch-1 step at the shortest context in the workload
  (the latency model is monotone in batch and context). So no policy, and no switching however cheap,
  finishes before ``max length x min over layouts of step_ms(layout, 1, min prompt)``.
* Free-switch bound: what a pod reaches when switches cost nothing. It is the best of several zero-cost
  schedules under the same memory and admission model: switching at every completion to the layout a
  lockstep estimate (knowing every remaining length) says is fastest (:class:`GreedyController`), never
  switching (each static layout), and every chain the policies and the oracles ran, at zero switch cost (a
  run does not depend on absolute time, so that is its latency minus its switch costs). It bounds from
  below what better *timing and cost* of switches can buy over those schedules; it is an achievable value,
  not a proof that nothing faster exists (the tail bound is the proof).
"""

from __future__ import annotations

from rollout_profiler.sim.config import SimResult
from rollout_profiler.sim.policies import GreedyController
from rollout_profiler.sim.simulator import Simulator


def tail_bound(sim: Simulator) -> SimResult:
    layouts = sim.candidates()
    ctx = float(sim.prompt.min())
    best = min(sim.model.step_ms(lay, 1.0, ctx) for lay in layouts)
    ms = float(sim.lengths.max()) * best
    detail = f"{int(sim.lengths.max())} steps x {best:.3f} ms (batch 1, context {ctx:.0f}, best layout)"
    return SimResult("tail-bound", ms / 1e3, 0.0, [], [], detail, sim.cfg.admission)


def free_switch_bound(sim: Simulator, others: list[SimResult]) -> SimResult:
    """The best zero-switch-cost schedule among the greedy switcher and ``others`` without their costs."""
    layouts = sorted(sim.candidates(), key=lambda lay: lay.tp)
    greedy = sim.run(layouts[0], name="free-switch", controller=GreedyController(layouts), free_switches=True)
    greedy.detail = f"greedy: {len(greedy.reconfigs)} free switches"
    best = greedy
    for r in others:
        ms = r.latency_s - r.switch_ms / 1e3
        if ms < best.latency_s:
            why = f"{r.policy} at zero switch cost ({len(r.reconfigs)} switches)"
            best = r.adopted("free-switch", why, free_switches=True)
    return best
