"""How right the planner's predictions are: the adaptive controller, probed. At given times of a run it also
asks the planner (:func:`~rollout_profiler.planning.forecast.finish_ms`, from what the pod reports, with
the predictor the tick fits) how long the pod will take to finish, in the layout it is in and, with
``candidates`` (a policy), in each layout that policy may switch to, and plays forks of the run
(:meth:`Simulator.fork`) to the end to see. The probes change nothing in the run: a probed run is the run."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rollout_profiler.planning.forecast import finish_ms
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.planning.tick import predictor, snapshot
from rollout_profiler.sim.config import SimResult, Switch
from rollout_profiler.sim.policies import AdaptiveController, run_adaptive, start_layout
from rollout_profiler.sim.simulator import Simulator


@dataclass(frozen=True, slots=True)
class Probe:
    t_s: float  # when
    layout: str  # the layout the fork finished in (``current``: the one the pod was in)
    current: bool
    predicted_s: float  # time to finish, the planner's
    simulated_s: float  # ... and the fork's (a switch's own cost left out)

    @property
    def error(self) -> float:
        """Relative error of the prediction (+: the planner expects longer)."""
        return self.predicted_s / self.simulated_s - 1


class ProbedController(AdaptiveController):
    """:class:`AdaptiveController` that probes the planner at each of ``times_ms`` (module docstring)."""

    def __init__(
        self, sim: Simulator, times_ms: list[float], candidates: PlannerPolicy | None = None
    ) -> None:
        super().__init__(sim.policy(), sim.cfg.prior, sim.cfg.decide_every_ms)
        self.probe_at, self.candidates = sorted(times_ms), candidates
        self.probes: list[Probe] = []

    def on_time(self, sim: Simulator, t_ms: float) -> Switch | None:
        if self.probe_at and t_ms >= self.probe_at[0] and sim.unfinished():
            self.probe_at.pop(0)
            self._probe(sim, t_ms)
        return super().on_time(sim, t_ms)

    def _probe(self, sim: Simulator, t_ms: float) -> None:
        memory = replace(self.memory, lengths=list(self.memory.lengths), capped=list(self.memory.capped))
        state = sim.state(t_ms, memory.since_step)
        memory.absorb(state)
        snap = snapshot(state)
        pred = predictor(memory, snap, self.prior)
        for lay, ms in finish_ms(sim.model, snap, self.candidates or self.policy, pred).items():
            if lay != sim.layout and self.candidates is None:
                continue
            fork, cost = sim.fork(), 0.0
            if lay != sim.layout:
                work = pred.expected_remaining(fork.gen_at(t_ms), fork.cap)
                fork.switch(Switch(lay, "auto", work, "probe"), t_ms)
                cost = fork.events[-1].predicted_ms
            done = fork.resume("probe").latency_s * 1e3
            self.probes.append(
                Probe(t_ms / 1e3, str(lay), lay == sim.layout, ms / 1e3, (done - t_ms - cost) / 1e3)
            )


def probed_adaptive(
    sim: Simulator, fractions: tuple[float, ...], candidates: PlannerPolicy | None = None
) -> tuple[SimResult, list[Probe]]:
    """The adaptive run, probed at ``fractions`` of the time its start layout alone would take; with
    ``candidates``, the layouts that policy may switch to are probed too."""
    start = start_layout(sim, sim.policy(), sim.cfg.prior)
    alone = sim.run(start, name="probe-length").latency_s * 1e3
    ctl = ProbedController(sim, [alone * f for f in fractions], candidates)
    return run_adaptive(sim, controller=ctl), ctl.probes


def median_abs_error(probes: list[Probe]) -> float | None:
    return float(np.median([abs(p.error) for p in probes])) if probes else None
