"""The controllers that decide a pod's switches in the simulator.

* :class:`AdaptiveController`: the operator's planner loop, every ``decide_every_ms`` of simulated time: it
  reads what the pod would report (:meth:`Simulator.state`: finished lengths, generated lengths so far,
  waiting requests; its switch events), runs the same pure tick as the operator
  (:func:`rollout_profiler.planning.tick.tick`: hysteresis, the cooldown from the last committed switch, the
  new-wave shrink) and pushes its plan, whose triggers fire as the engine fires them, now and when
  unfinished requests drop to their thresholds; switches rebalance by predicted remaining work.
  :func:`run_adaptive` also lets the planner pick the start layout.
* :class:`ScheduleController`: replays triggers "when unfinished <= n, switch to L", balancing by the true
  remaining length (a clairvoyant schedule) or, with ``balance="count"``, by count (blind to lengths).
* :class:`GreedyController`: switches for free whenever a request finishes to the layout a lockstep estimate
  with the true remaining lengths says is fastest from here (:func:`lockstep_ms`); used by the free-switch
  bound, never by a policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.planning.planner import Decision, choose_start
from rollout_profiler.planning.policy import PlannerPolicy, PodSnapshot, ReplicaState
from rollout_profiler.planning.predictor import Prior, fit
from rollout_profiler.planning.tick import PodMemory, TickResult, predictor, snapshot, tick
from rollout_profiler.sim.config import SimResult, Switch
from rollout_profiler.sim.memory import DONE
from rollout_profiler.sim.simulator import Simulator

_LOCKSTEP_POINTS = 48


class _Never:
    """No decisions on the clock, no reaction to finished requests."""

    def next_time(self, sim: Simulator) -> float:
        return math.inf

    def on_time(self, sim: Simulator, t_ms: float) -> Switch | None:
        return None

    def on_finish(self, sim: Simulator, t_ms: float) -> Switch | None:
        return None

    def switched(self, sim: Simulator, t_end_ms: float) -> None:
        return None


class AdaptiveController(_Never):
    """The operator's planner loop on one simulated pod: every ``every_ms``, read the pod's state and switch
    events, tick, push the plan (the engine fires its triggers); it sees no length before it is finished."""

    def __init__(self, policy: PlannerPolicy, prior: Prior | None, every_ms: float) -> None:
        self.policy, self.prior, self.every = policy, prior, every_ms
        self.memory = PodMemory()
        self.results: list[TickResult] = []
        self.times: list[float] = []  # ms of each tick
        self._next = 0.0

    @property
    def decisions(self) -> list[Decision]:
        return [r.decision for r in self.results]

    def next_time(self, sim: Simulator) -> float:
        return self._next

    def on_time(self, sim: Simulator, t_ms: float) -> Switch | None:
        self._next = t_ms + self.every
        state = sim.state(t_ms, self.memory.since_step)
        self.memory.absorb(state)
        self.memory.note_events(sim.events)
        result = tick(state, self.memory, sim.model, self.policy, self.prior)
        self.results.append(result)
        self.times.append(t_ms)
        if result.plan is None or state.reconfiguring or not sim.set_plan(result.plan):
            return None
        return self._fire(sim, t_ms)  # its first trigger sits at the current unfinished count

    def on_finish(self, sim: Simulator, t_ms: float) -> Switch | None:
        return self._fire(sim, t_ms)

    def _fire(self, sim: Simulator, t_ms: float) -> Switch | None:
        trig = sim.fire()
        if trig is None:
            return None
        state = sim.state(t_ms, self.memory.since_step)
        pred = predictor(self.memory, snapshot(state), self.prior)
        work = pred.expected_remaining(sim.gen_at(t_ms), sim.cap)  # (only unfinished entries are used)
        why = f"plan: unfinished {sim.unfinished()} <= {trig.unfinished_at_most}"
        return Switch(trig.layout, trig.method, work, why)

    def switched(self, sim: Simulator, t_end_ms: float) -> None:
        self._next = t_end_ms + self.every


class ScheduleController(_Never):
    """Replays ``[(unfinished_at_most, layout)]`` in order, each firing when unfinished requests drop to
    its threshold; requests balanced by true remaining length, or by count with ``balance="count"``."""

    def __init__(
        self, schedule: list[tuple[int, Layout]], method: str = "auto", balance: str = "length"
    ) -> None:
        self.schedule, self.method, self.balance, self._i = schedule, method, balance, 0

    def on_finish(self, sim: Simulator, t_ms: float) -> Switch | None:
        if self._i >= len(self.schedule) or sim.unfinished() > self.schedule[self._i][0]:
            return None
        _, layout = self.schedule[self._i]
        self._i += 1
        if layout == sim.layout:
            return None
        work = np.zeros_like(sim.lengths) if self.balance == "count" else sim.lengths - sim.req.gen
        return Switch(layout, self.method, work, f"schedule: unfinished <= {self.schedule[self._i - 1][0]}")


def lockstep_ms(sim: Simulator, layout: Layout, rem: np.ndarray, ctx0: np.ndarray) -> float:
    """Time to finish requests with remaining lengths ``rem`` and contexts ``ctx0`` in ``layout``, all
    progressing together (balanced, in turns when a replica cannot hold its share)."""
    if rem.size == 0:
        return 0.0
    order = np.argsort(rem)
    r, c = rem[order], ctx0[order]
    top = float(r[-1])
    k = np.unique(np.concatenate([[0.0], np.quantile(r, np.linspace(0, 1, _LOCKSTEP_POINTS)), [top]]))
    mid = (k[1:] + k[:-1]) / 2
    first = np.searchsorted(r, mid, side="right")  # requests still running at mid
    n = r.size - first
    csum = np.concatenate([np.cumsum(c[::-1])[::-1], [0.0]])
    ctx = csum[first] / np.maximum(n, 1) + mid
    b = np.maximum(n / layout.replicas, 1.0)
    tokens = sim.kv_tokens(layout)
    per = (sim.prompt + sim.cap).mean() if sim.cfg.admission == "engine" else ctx
    limit = np.maximum(np.minimum(tokens / per, sim.cfg.max_batch or math.inf), 1.0)
    turns = np.maximum(b / limit, 1.0)
    step = sim.model.step_ms_many(layout, np.minimum(b, limit), ctx)
    return float((np.diff(k) * step * turns).sum())


class GreedyController(_Never):
    """Free switches: at every completion, to the layout :func:`lockstep_ms` finds fastest from here
    (knowing every remaining length); balanced by true remaining length."""

    def __init__(self, layouts: list[Layout]) -> None:
        self.layouts = layouts

    def on_finish(self, sim: Simulator, t_ms: float) -> Switch | None:
        left = np.nonzero(sim.req.status != DONE)[0]
        rem = sim.lengths[left] - sim.req.gen[left]
        ctx0 = sim.prompt[left] + sim.req.gen[left]
        best = min(self.layouts, key=lambda lay: (lockstep_ms(sim, lay, rem, ctx0), lay.tp))
        if best == sim.layout:
            return None
        return Switch(best, "auto", sim.lengths - sim.req.gen, "free switch to the fastest layout")


def start_layout(sim: Simulator, policy: PlannerPolicy, prior: Prior | None) -> Layout:
    """Adaptive's first layout: ``initial_layout`` of the config (``auto``: the planner's choice)."""
    choice = sim.cfg.initial_layout
    if choice == "smallest":
        return min(policy.candidates, key=lambda lay: lay.tp)
    if choice != "auto":
        lay = Layout.parse(choice, "initial_layout")
        if not sim.fits(lay):
            raise UserError(f"a request does not fit one replica of {lay} (KV capacity)", "initial_layout")
        return lay
    n = sim.lengths.size
    rep = ReplicaState(sim.prompt[:0], sim.prompt[:0], sim.cap[:0], n)
    snap = PodSnapshot(
        Layout(sim.cfg.gpus, 1),
        (rep,),
        (True,) * sim.cfg.gpus,
        0,
        0.0,
        int(sim.prompt.mean()),
        int(sim.cap.max()),
    )
    pred = fit(np.zeros(0), np.zeros(n), sim.cap, None, prior)
    return choose_start(sim.model, snap, policy, pred)


def run_adaptive(
    sim: Simulator,
    on_decision: Callable[[Decision], None] | None = None,
    controller: AdaptiveController | None = None,
) -> SimResult:
    """The adaptive policy's run from the layout it starts in; ``controller``: an adaptive controller of
    its own (the probed one, :mod:`~rollout_profiler.sim.probe`), else the plain one."""
    policy = sim.policy()
    ctl = controller or AdaptiveController(policy, sim.cfg.prior, sim.cfg.decide_every_ms)
    start = start_layout(sim, policy, sim.cfg.prior)
    res = sim.run(start, name="adaptive", controller=ctl)
    res.detail = f"{len(ctl.decisions)} decisions; start {start} ({sim.cfg.initial_layout})"
    if on_decision:
        for d in ctl.decisions:
            on_decision(d)
    return res
