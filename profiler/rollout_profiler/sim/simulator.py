"""Step-level simulation of one pod generating one rollout batch.

The pod runs in lockstep: every step each replica decodes one token for each of its running requests,
and the step lasts as long as the slowest replica, ``max_r LatencyModel.step_ms(layout, batch_r, ctx_r)``
(``ctx_r`` = mean prompt + generated tokens on replica ``r``). Request ``i`` leaves after ``lengths[i]``
steps. The simulation is event-driven: between two events (a request finishing, a decision point, a
recording mark, at most ``max_segment`` steps) batches are constant and contexts grow by one token per
step, so a segment of ``n`` steps costs ``n`` x the step at its mid-context (exact where the step is
linear in context). With ``max_batch_per_replica``, extra requests wait in their replica's FIFO queue.

Policies: ``static:T`` (layout G/T x T throughout, requests dealt round-robin), ``adaptive`` (the real
predictor + planner every ``decide_every`` steps, seeing only finished lengths and current lengths;
switches rebalance requests by predicted remaining work), ``oracle`` (see :mod:`rollout_profiler.sim.oracle`).
Switch costs come from the profile's CostModel (:func:`~rollout_profiler.planning.planner.switch_cost`);
the pod generates nothing while it switches.

GPU-busy fraction = sum over steps of step x (GPUs of replicas with a non-empty batch) / (G x latency).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout, candidate_layouts

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import (
    Decision,
    LastSwitch,
    PlannerPolicy,
    PodSnapshot,
    ReplicaState,
    decide,
    switch_cost,
)
from rollout_profiler.planning.predictor import LengthPredictor, Prior, fit
from rollout_profiler.sim.workloads import Workload


@dataclass(frozen=True, slots=True)
class SimConfig:
    gpus: int
    decide_every: int = 32
    max_batch_per_replica: int | None = None
    max_segment: int = 256
    planner: PlannerPolicy | None = None  # default: every profiled TP that fits, default hysteresis
    prior: Prior | None = None
    oracle_per_octave: int = 3

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.decide_every < 1 or self.max_segment < 1 or self.oracle_per_octave < 1:
            raise UserError("gpus, decide_every, max_segment and oracle_per_octave must be >= 1")
        if self.max_batch_per_replica is not None and self.max_batch_per_replica < 1:
            raise UserError(f"max_batch_per_replica must be >= 1, got {self.max_batch_per_replica}")


@dataclass(frozen=True, slots=True)
class Reconfig:
    step: int
    time_s: float
    src: str
    dst: str
    method: str
    cost_ms: float
    running: int


@dataclass(slots=True)
class SimResult:
    policy: str
    latency_s: float
    gpu_busy: float
    reconfigs: list[Reconfig]
    timeline: list[tuple[float, int, int]]  # (time s, running requests, TP)
    detail: str = ""
    marks: dict[int, float] = field(default_factory=dict)  # step -> elapsed ms (oracle bookkeeping)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "policy": self.policy,
            "latency_s": self.latency_s,
            "gpu_busy": self.gpu_busy,
            "reconfigurations": len(self.reconfigs),
            "reconfigs": [asdict(r) for r in self.reconfigs],
            "detail": self.detail,
        }
        if timeline:
            d["timeline"] = [list(x) for x in self.timeline]
        return d


@dataclass(frozen=True, slots=True)
class Switch:
    layout: Layout
    method: str
    work: np.ndarray  # per request: key for balancing (remaining work); only unfinished entries are used


class Controller(Protocol):
    def next_call(self, step: int) -> float: ...

    def __call__(self, sim: Simulator, step: int, time_ms: float) -> Switch | None: ...


class Simulator:
    """One workload on one pod; ``run`` is one pass (used by every policy and by the oracle's phases)."""

    def __init__(self, model: LatencyModel, workload: Workload, cfg: SimConfig) -> None:
        self.model, self.wl, self.cfg = model, workload, cfg
        self.lengths = workload.lengths.astype(float)
        self.prompt = workload.prompt_lens.astype(float)
        self.cap = workload.caps.astype(float)
        prof = model.profile
        self.kv_bytes = prof.model.kv_bytes_per_token(prof.dtype_bytes)
        # run state (reset by run)
        self.layout = Layout(cfg.gpus, 1)
        self.rep = np.zeros(0, dtype=np.int64)
        self.start = np.zeros(0)
        self.end = np.zeros(0)
        self.waiting = np.zeros(0, dtype=bool)
        self.done = np.zeros(0, dtype=bool)

    def candidates(self) -> list[Layout]:
        m = self.model.profile.model
        profiled = {lay.tp for lay in self.model.layouts}
        fits = candidate_layouts(self.cfg.gpus, m.num_heads, m.num_kv_heads, m.vocab_size)
        return [lay for lay in fits if lay.tp in profiled]

    def policy(self) -> PlannerPolicy:
        if self.cfg.planner is not None:
            return self.cfg.planner
        return PlannerPolicy(tuple(self.candidates()), max_batch_per_replica=self.cfg.max_batch_per_replica)

    def generated(self, idx: np.ndarray, step: int) -> np.ndarray:
        return step - self.start[idx]

    def _assign(self, layout: Layout, work: np.ndarray, idx: np.ndarray) -> None:
        """Deal ``idx`` over the replicas in snake order of decreasing work (close to LPT balancing)."""
        order = idx[np.argsort(-work[idx], kind="stable")]
        d = layout.replicas
        pos = np.arange(order.size) % (2 * d)
        self.rep[order] = np.where(pos < d, pos, 2 * d - 1 - pos)

    def _admit(self, step: int) -> None:
        mb = self.cfg.max_batch_per_replica
        if mb is None or not self.waiting.any():
            return
        running = np.isfinite(self.end)
        counts = np.bincount(self.rep[running], minlength=self.layout.replicas)
        for r in range(self.layout.replicas):
            free = mb - int(counts[r])
            if free > 0:
                w = np.nonzero(self.waiting & (self.rep == r))[0][:free]
                self.waiting[w] = False
                self.start[w] = step
                self.end[w] = step + self.lengths[w]

    def run(
        self,
        layout: Layout,
        *,
        name: str,
        start_step: int = 0,
        work: np.ndarray | None = None,
        controller: Controller | None = None,
        marks: tuple[int, ...] = (),
    ) -> SimResult:
        """From ``start_step`` (all requests admitted at step 0; > 0 only without a batch limit)."""
        n, cfg, g = self.lengths.size, self.cfg, self.cfg.gpus
        if layout.world != g:
            raise UserError(f"layout {layout} has {layout.world} ranks, the pod has {g} GPUs")
        if start_step and cfg.max_batch_per_replica is not None:
            raise UserError("a run can start after step 0 only without a batch limit")
        self.layout = layout
        self.done = self.lengths <= start_step
        self.rep = np.zeros(n, dtype=np.int64)
        live = np.nonzero(~self.done)[0]
        if work is None:
            self.rep[live] = np.arange(live.size) % layout.replicas
        else:
            self._assign(layout, work, live)
        self.start = np.zeros(n)
        self.end = np.where(self.done, np.inf, self.lengths)
        self.waiting = np.zeros(n, dtype=bool)
        if cfg.max_batch_per_replica is not None:
            self.waiting[:] = True
            self.end[:] = np.inf
            self._admit(0)
        step, t, busy = start_step, 0.0, 0.0
        reconfigs: list[Reconfig] = []
        timeline = [(0.0, int(live.size), layout.tp)]
        pending = sorted(m for m in marks if m > step)
        got: dict[int, float] = {}
        while True:
            running = np.isfinite(self.end)
            if not running.any() and not self.waiting.any():
                break
            if controller is not None and step >= controller.next_call(step):
                sw = controller(self, step, t)
                if sw is not None:
                    t += self._switch(sw, step, t, reconfigs)
                    timeline.append((t / 1e3, int(running.sum() + self.waiting.sum()), self.layout.tp))
                    running = np.isfinite(self.end)
            nxt = min(float(self.end.min()), float(step + cfg.max_segment))
            if controller is not None:
                nxt = min(nxt, max(controller.next_call(step), step + 1))
            if pending:
                nxt = min(nxt, pending[0])
            seg = int(nxt) - step
            idx = np.nonzero(running)[0]
            if idx.size:
                d = self.layout.replicas
                b = np.bincount(self.rep[idx], minlength=d)
                ctx = np.bincount(
                    self.rep[idx], weights=self.prompt[idx] + step - self.start[idx], minlength=d
                )
                mid = (seg - 1) / 2
                ms = max(
                    self.model.step_ms(self.layout, float(b[r]), float(ctx[r]) / float(b[r]) + mid)
                    for r in range(d)
                    if b[r]
                )
                t += seg * ms
                busy += seg * ms * self.layout.tp * int((b > 0).sum())
            step += seg
            fin = self.end <= step
            if fin.any():
                self.done |= fin
                self.end[fin] = np.inf
                self._admit(step)
                timeline.append(
                    (t / 1e3, int(np.isfinite(self.end).sum() + self.waiting.sum()), self.layout.tp)
                )
            while pending and pending[0] <= step:
                got[pending.pop(0)] = t
        gpu_busy = busy / (g * t) if t > 0 else 0.0
        return SimResult(name, t / 1e3, gpu_busy, reconfigs, timeline, marks=got)

    def _switch(self, sw: Switch, step: int, t: float, log: list[Reconfig]) -> float:
        prof = self.model.profile
        running = np.isfinite(self.end)
        tokens = float((self.prompt[running] + step - self.start[running]).sum())
        method, ms = switch_cost(
            prof.costs, self.kv_bytes, prof.model.num_kv_heads, self.layout, sw.layout, tokens, sw.method
        )
        unfinished = np.nonzero(~self.done)[0]
        log.append(
            Reconfig(step, t / 1e3, str(self.layout), str(sw.layout), method, ms, int(unfinished.size))
        )
        self.layout = sw.layout
        self._assign(sw.layout, sw.work, unfinished)
        self._admit(step)
        return ms


class AdaptiveController:
    """The real predictor + planner, seeing only finished lengths and current generated lengths."""

    def __init__(self, sim: Simulator, policy: PlannerPolicy, prior: Prior | None, every: int) -> None:
        self.policy, self.prior, self.every = policy, prior, every
        self.last: LastSwitch | None = None
        self.decisions: list[Decision] = []
        self.steps: list[int] = []  # step of each decision
        self._next = 0
        self.sim = sim

    def next_call(self, step: int) -> float:
        return self._next

    def predictor(self, sim: Simulator, step: int) -> LengthPredictor:
        run = np.nonzero(np.isfinite(sim.end))[0]
        return fit(
            sim.lengths[sim.done], sim.generated(run, step), sim.cap[run], sim.cap[sim.done], self.prior
        )

    def __call__(self, sim: Simulator, step: int, time_ms: float) -> Switch | None:
        self._next = step + self.every
        pred = self.predictor(sim, step)
        running = np.isfinite(sim.end)
        reps = []
        for r in range(sim.layout.replicas):
            idx = np.nonzero(running & (sim.rep == r))[0]
            n_wait = int((sim.waiting & (sim.rep == r)).sum())
            reps.append(ReplicaState(sim.prompt[idx], sim.generated(idx, step), sim.cap[idx], n_wait))
        snap = PodSnapshot(sim.layout, tuple(reps), (True,) * sim.layout.world, step, time_ms / 1e3)
        d = decide(sim.model, snap, self.policy, pred, self.last)
        self.decisions.append(d)
        self.steps.append(step)
        if d.action != "switch" or d.method is None:
            return None
        self.last = LastSwitch(step, time_ms / 1e3)
        gen = np.where(running, step - sim.start, 0.0)
        work = pred.expected_remaining(gen, sim.cap)
        return Switch(d.target, d.method, work)


class ScheduleController:
    """Replays a fixed schedule [(step, layout)], balancing by the true remaining length (oracle) or,
    with ``balance="count"``, by count only (requests dealt in index order, blind to lengths)."""

    def __init__(
        self, schedule: list[tuple[int, Layout]], method: str = "auto", balance: str = "length"
    ) -> None:
        self.schedule, self.method, self.balance, self._i = schedule, method, balance, 0

    def next_call(self, step: int) -> float:
        return self.schedule[self._i][0] if self._i < len(self.schedule) else float("inf")

    def __call__(self, sim: Simulator, step: int, time_ms: float) -> Switch | None:
        _, layout = self.schedule[self._i]
        self._i += 1
        if self.balance == "count":
            return Switch(layout, self.method, np.zeros_like(sim.lengths))
        gen = np.where(np.isfinite(sim.end), step - sim.start, 0.0)
        return Switch(layout, self.method, sim.lengths - gen)


def run_adaptive(sim: Simulator, on_decision: Callable[[Decision], None] | None = None) -> SimResult:
    policy = sim.policy()
    ctl = AdaptiveController(sim, policy, sim.cfg.prior, sim.cfg.decide_every)
    start = min(policy.candidates, key=lambda lay: lay.tp)
    res = sim.run(start, name="adaptive", controller=ctl)
    res.detail = f"{len(ctl.decisions)} decisions; start {start}"
    if on_decision:
        for d in ctl.decisions:
            on_decision(d)
    return res
