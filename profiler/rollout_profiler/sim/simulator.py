"""Step-level simulation of one pod generating one rollout batch, as the engine runs it.

Replicas are independent. Every replica of the layout ``D x T`` decodes its own batch at its own pace: a
step of replica ``r`` lasts ``LatencyModel.step_ms(layout, batch_r, ctx_r)`` (``ctx_r`` = the mean prompt +
generated tokens of its running requests) and nobody waits for the slowest replica. Requests are dispatched
to replicas when they arrive (all at time 0, in order: the replica with the fewest unfinished requests
first) and wait in that replica's queue until admitted. The replicas meet only to reconfigure: at a switch
each replica finishes the step it is in, the pod pays the switch cost (the one
:class:`~rollout_worker.scheduling.costs.CostModel`, :func:`~rollout_profiler.planning.planner.switch_cost`),
and
the unfinished requests are rebalanced over the new replicas by remaining work, longest first (equal work:
by count).

The simulation is event-driven: each replica advances in segments during which its batch is constant (a
segment ends at the next completion, when its KV memory runs out, or at the next multiple of
``max_segment`` steps), a segment of ``n`` steps costs ``n`` x the step at its mid-context, and segments of
different replicas are committed in the order they end, so completions happen in wall-clock order.

Memory (:mod:`rollout_profiler.sim.memory`): each replica holds at most the profile's KV capacity for its
TP size (unlimited when the profile does not say), under one of two admission policies, named in every
result: ``engine`` (a request is admitted when a slot is free and its prompt + max_new_tokens fit the
tokens not yet reserved; nothing is ever preempted) and ``sglang`` (admitted when its current tokens fit
what is used now; when the next step does not fit, the newest request is preempted and later re-prefilled,
its prompt + generated tokens at the replica's prefill rate). Prefill of the prompts themselves is not
modelled (the same work for every layout), except under ``paged``, which follows the engine step by step
(:mod:`rollout_profiler.sim.memory`).

Controllers decide switches: by wall clock (``next_time`` / ``on_time``, the planner) or when requests
finish (``on_finish``: a pushed plan's triggers, schedules replayed from triggers "when unfinished <= n").
The adaptive controller reads only what the pod would report (:meth:`Simulator.state`, ``events``), runs
the operator's planner tick on it, and the plan it pushes (:meth:`Simulator.set_plan`) fires as the engine
fires plans (:meth:`Simulator.fire`). The step clock counts as the engine's does (+1 per replica decode step
and per switch), and a switch's event carries the step and time of its commit. Nothing in a run depends on
absolute time, so a run whose switches cost 0 is the same run shifted: its latency is the latency minus the
switch costs (the free-switch bound relies on this).

GPU-busy fraction = sum over segments of step x T (replicas with a non-empty batch) / (G x latency).
"""

from __future__ import annotations

import copy
import math
from typing import Protocol

import numpy as np
from rollout_worker.api.plan import Plan, ReconfigEvent, Trigger
from rollout_worker.api.state import EngineState
from rollout_worker.errors import UserError
from rollout_worker.scheduling.costs import METHODS, estimated_moved_bytes
from rollout_worker.scheduling.layout import Layout, candidate_layouts

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import switch_cost
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.sim.config import SimConfig, SimResult, Switch
from rollout_profiler.sim.memory import DONE, RUNNING, WAITING, Admission, Requests, balance
from rollout_profiler.sim.view import engine_state
from rollout_profiler.sim.workloads import Workload


class Progress(Protocol):
    """Told, before every event of a run, its name, the simulated ms of that event and the requests
    unfinished (a long run ticks the planner every ``decide_every_ms`` of simulated time: hours of a slow
    profile's batch are tens of thousands of ticks)."""

    def __call__(self, run: str, t_ms: float, unfinished: int) -> None: ...


class Controller(Protocol):
    def next_time(self, sim: Simulator) -> float: ...

    def on_time(self, sim: Simulator, t_ms: float) -> Switch | None: ...

    def on_finish(self, sim: Simulator, t_ms: float) -> Switch | None: ...

    def switched(self, sim: Simulator, t_end_ms: float) -> None: ...


class Simulator:
    """One workload on one pod; ``run`` is one pass (used by every policy, the oracles and the bounds)."""

    def __init__(
        self, model: LatencyModel, workload: Workload, cfg: SimConfig, progress: Progress | None = None
    ) -> None:
        self.model, self.wl, self.cfg, self.progress = model, workload, cfg, progress
        self.lengths = workload.lengths.astype(float)
        self.prompt = workload.prompt_lens.astype(float)
        self.cap = workload.caps.astype(float)
        prof = model.profile
        self.kv_bytes = prof.model.kv_bytes_per_token(prof.dtype_bytes)
        capacity = cfg.kv_capacity if cfg.kv_capacity is not None else prof.kv_capacity
        self.capacity = capacity if cfg.memory else None
        self.layout = Layout(cfg.gpus, 1)
        self.req = Requests.start(self.prompt, self.cap, self.lengths, 0.0)
        self.free = False
        self.plan: Plan | None = None

    # --- what a layout can do -----------------------------------------------------------------------

    def kv_tokens(self, layout: Layout) -> float:
        """KV tokens one replica of ``layout`` holds (inf: unknown)."""
        got = None if self.capacity is None else self.capacity.tokens(layout.tp)
        return math.inf if got is None else float(got)

    def fits(self, layout: Layout) -> bool:
        """Whether every request can run alone on one replica of ``layout`` (else the layout is unusable)."""
        return float((self.prompt + self.cap).max()) <= self.kv_tokens(layout)

    def candidates(self) -> list[Layout]:
        m = self.model.profile.model
        profiled = {lay.tp for lay in self.model.layouts}
        fits = candidate_layouts(self.cfg.gpus, m.num_heads, m.vocab_size)
        return [lay for lay in fits if lay.tp in profiled and self.fits(lay)]

    def policy(self) -> PlannerPolicy:
        if self.cfg.planner is not None:
            return self.cfg.planner
        caps = {
            lay.tp: int(self.kv_tokens(lay))
            for lay in self.candidates()
            if math.isfinite(self.kv_tokens(lay))
        }
        return PlannerPolicy(
            tuple(self.candidates()),
            max_batch_per_replica=self.cfg.max_batch,
            kv_tokens_per_replica=tuple(sorted(caps.items())),
            admission=self.cfg.admission,
        )

    # --- state seen by controllers ------------------------------------------------------------------

    def unfinished(self) -> int:
        return int((self.req.status != DONE).sum())

    def gen_at(self, t_ms: float) -> np.ndarray:
        """Generated tokens of every request at ``t_ms`` (replicas mid-segment counted step by step)."""
        gen = self.req.gen.copy()
        for r in range(self.layout.replicas):
            n, ms, clock = self._pend_n[r], self._pend_ms[r], self._clock[r]
            if n and t_ms > clock:
                done = min(int(n), int((t_ms - clock) // ms))
                if done:
                    gen[self.req.on(r, RUNNING)] += done
        return gen

    def state(self, t_ms: float, since_step: int = 0) -> EngineState:
        """What the pod's engine would report at ``t_ms`` (:func:`~rollout_profiler.sim.view.engine_state`):
        read-only: all the planner tick sees of a run."""
        stepping = self._pend_ms[self._pend_n > 0]
        return engine_state(
            self.req,
            self.gen_at(t_ms),
            self.layout,
            step=self._engine_step,
            time_s=t_ms / 1e3,
            step_ms=float(np.median(stepping)) if stepping.size else None,
            finished_at=self._finished_at,
            since_step=since_step,
            plan=self.plan,
            switches=len(self.events),
        )

    def set_plan(self, plan: Plan) -> bool:
        """Hold ``plan`` as the engine would (``PUT /v1/plan``); False, as the engine's 409, when it is based
        on another layout than the current one."""
        if plan.based_on_layout != self.layout:
            return False
        self.plan = plan
        return True

    def fire(self) -> Trigger | None:
        """The held plan's trigger due now, if any (:meth:`~rollout_worker.api.plan.Plan.fire`)."""
        if self.plan is None:
            return None
        trig, self.plan = self.plan.fire(self.unfinished(), self.layout)
        return trig

    def _admission(self, layout: Layout) -> Admission:
        rate = self.model.profile.costs.recompute_tokens_per_ms * layout.tp / self.cfg.gpus
        cfg = self.cfg
        return Admission(
            cfg.admission,
            cfg.max_batch,
            self.kv_tokens(layout),
            rate,
            layout.replicas,
            cfg.page_size,
            lambda batch, ctx: self.model.step_ms(layout, float(batch), ctx),
        )

    # --- one run ------------------------------------------------------------------------------------

    def run(
        self,
        layout: Layout,
        *,
        name: str,
        start_gen: float = 0.0,
        work: np.ndarray | None = None,
        controller: Controller | None = None,
        marks: tuple[int, ...] = (),
        free_switches: bool = False,
    ) -> SimResult:
        """From ``start_gen`` tokens generated by every request (> 0: the state a switch would carry over,
        KV caches present), requests placed by ``work`` (None: dispatched by count)."""
        g = self.cfg.gpus
        if layout.world != g:
            raise UserError(f"layout {layout} has {layout.world} ranks, the pod has {g} GPUs", "layout")
        if not self.fits(layout):
            raise UserError(f"a request does not fit one replica of {layout} (KV capacity)", "layout")
        self.layout, self.free = layout, free_switches
        self.mem = self._admission(layout)
        req = self.req = Requests.start(self.prompt, self.cap, self.lengths, start_gen)
        self.events: list[ReconfigEvent] = []
        self.plan = None
        self._engine_step = 0  # the engine's step clock: +1 per replica decode step and per switch
        self._finished_at = np.where(req.status == DONE, 0, -1)  # engine step at which each finished
        live = np.nonzero(req.status != DONE)[0]
        req.rep[live] = balance(np.zeros(req.gen.size) if work is None else work, live, layout.replicas)
        if start_gen > 0 and self.cfg.admission == "paged":  # their KV is there: they run, as after a switch
            for d in range(layout.replicas):
                self.mem.carry(req, d, live[req.rep[live] == d])
        self._reset_replicas(0.0)
        self.busy = 0.0
        self.timeline = [(0.0, int(live.size), layout.tp)]
        self.pending_marks = sorted((m for m in marks if m < live.size), reverse=True)
        self.got: dict[int, float] = {}
        return self.resume(name, controller)

    def fork(self) -> Simulator:
        """A copy of this run as it stands (between events, e.g. at a controller's decision), sharing only
        what never changes (model, workload, config): :meth:`resume` continues it alone, and :meth:`switch`
        can make it take another path. What a planner predicts from a state is checked against a fork."""
        keep = {id(x): x for x in (self.model, self.wl, self.cfg, self.progress)}
        return copy.deepcopy(self, keep)

    def switch(self, sw: Switch, t_ms: float) -> None:
        """Switch now (at ``t_ms``), as a controller's switch would."""
        self._switch(sw, t_ms, None)

    def resume(self, name: str, controller: Controller | None = None) -> SimResult:
        """Run to the end from where the run stands (:meth:`run` starts here after placing the requests)."""
        req = self.req
        while left := self.unfinished():
            self._refresh()
            r = int(np.argmin(self._pend_end))
            t_dec = controller.next_time(self) if controller is not None else math.inf
            if self.progress is not None:  # at the next event: a decision, or a replica's segment ending
                self.progress(name, min(t_dec, float(self._pend_end[r])), left)
            if t_dec <= self._pend_end[r]:
                sw = controller.on_time(self, t_dec) if controller is not None else None
                if sw is not None:
                    self._switch(sw, t_dec, controller)
                continue
            if not math.isfinite(self._pend_end[r]):
                raise UserError(f"{name}: requests wait that no replica of {self.layout} can admit")
            finished = self._commit(r, self._pend_n[r])
            if finished and controller is not None:
                sw = controller.on_finish(self, self._clock[r])
                if sw is not None:
                    self._switch(sw, self._clock[r], controller)
        latency = float(self._latest)
        gpu_busy = self.busy / (self.cfg.gpus * latency) if latency > 0 else 0.0
        return SimResult(
            name,
            latency / 1e3,
            gpu_busy,
            self.events,
            self.timeline,
            admission=self.cfg.admission,
            preemptions=req.preemptions,
            recomputed_tokens=int(req.recomputed),
            marks=self.got,
        )

    def _reset_replicas(self, t_ms: float, steps: int = 0) -> None:
        d = self.layout.replicas
        self._clock = np.full(d, t_ms)
        self._latest = t_ms
        self._pend_n = np.zeros(d, dtype=np.int64)
        self._pend_ms = np.zeros(d)
        self._pend_end = np.full(d, math.inf)
        self._dirty = np.ones(d, dtype=bool)
        self._steps = np.full(d, steps, dtype=np.int64)  # decode steps so far (the pod's step: the most)

    def _refresh(self) -> None:
        """Admit, preempt and plan the next segment of every replica whose batch changed."""
        req = self.req
        for r in np.nonzero(self._dirty)[0]:
            self._dirty[r] = False
            self._clock[r] += self.mem.admit(req, int(r))
            run = self.mem.make_room(req, int(r))
            if run.size == 0:
                self._pend_n[r], self._pend_end[r] = 0, math.inf
                continue
            self.mem.held(req, run)
            left = int((req.lengths[run] - req.gen[run]).min())
            to_grid = self.cfg.max_segment - int(self._steps[r]) % self.cfg.max_segment  # (same cuts whatever
            steps = max(
                1, min(left, self.mem.steps_that_fit(req, run), to_grid)
            )  # the lengths still unknown)
            ctx = float((req.prompt[run] + req.gen[run]).mean()) + (steps - 1) / 2
            ms = self.model.step_ms(self.layout, float(run.size), ctx)
            self._pend_n[r], self._pend_ms[r] = steps, ms
            self._pend_end[r] = self._clock[r] + steps * ms

    def _commit(self, r: int, steps: int) -> bool:
        """Run ``steps`` of replica ``r``'s planned segment; True if requests finished."""
        req = self.req
        run = req.on(r, RUNNING)
        ms = self._pend_ms[r]
        req.gen[run] += steps
        self._clock[r] += steps * ms
        self._latest = max(self._latest, self._clock[r])
        self._steps[r] += steps
        self.mem.stepped(r, steps)
        self._engine_step += steps
        self.busy += steps * ms * self.layout.tp
        self._dirty[r] = True
        fin = run[req.gen[run] >= req.lengths[run]]
        if fin.size == 0:
            return False
        req.status[fin] = DONE
        self._finished_at[fin] = self._engine_step
        left = self.unfinished()
        t = self._clock[r]
        self.timeline.append((t / 1e3, left, self.layout.tp))
        while self.pending_marks and left <= self.pending_marks[0]:
            self.got[self.pending_marks.pop(0)] = t
        return True

    def _switch(self, sw: Switch, t_ms: float, controller: Controller | None) -> None:
        """Every replica finishes its current step, the pod pays the switch, requests are rebalanced."""
        for r in range(self.layout.replicas):
            if self._pend_n[r] and self._clock[r] < t_ms:
                self._commit(
                    r, min(int(self._pend_n[r]), math.ceil((t_ms - self._clock[r]) / self._pend_ms[r]))
                )
        if not self.unfinished():
            return
        req = self.req
        t0 = max(t_ms, float(self._clock.max()))
        running = np.nonzero(req.status == RUNNING)[0]
        tokens = float((req.prompt[running] + req.gen[running]).sum())
        prof = self.model.profile
        method, ms = switch_cost(
            prof.costs, self.kv_bytes, prof.model.num_kv_heads, self.layout, sw.layout, tokens, sw.method
        )
        moved = estimated_moved_bytes(tokens, self.kv_bytes, prof.model.num_kv_heads, self.layout, sw.layout)
        mig, rec = prof.costs.kv_ms(moved, tokens)  # the KV part alone, as the engine reports it
        requested = sw.method if sw.method in METHODS else "auto"
        unfinished = np.nonzero(req.status != DONE)[0]
        if self.free:
            ms = 0.0
        self._engine_step += 1
        self.events.append(
            ReconfigEvent(
                step=self._engine_step,
                time_s=(t0 + ms) / 1e3,  # committed
                src=self.layout,
                dst=sw.layout,
                requested=requested,
                method="migrate" if method == "migrate" else "recompute",
                reason=sw.reason or ("free switch" if self.free else "schedule"),
                requests_running=int(running.size),
                requests_waiting=int(unfinished.size - running.size),
                requests_mid_decode=int((req.gen[running] > 0).sum()),
                kv_bytes_moved=int(moved) if method == "migrate" else 0,
                kv_tokens_recomputed=int(tokens) if method == "recompute" else 0,
                predicted_ms=ms,
                predicted_migrate_ms=0.0 if self.free else float(mig),
                predicted_recompute_ms=0.0 if self.free else float(rec),
                actual_ms=ms,
            )
        )
        req.has_kv[running] = True  # carried over (migrated or recomputed: priced in the switch)
        req.status[unfinished] = WAITING
        carried_first = np.where(req.has_kv[unfinished], 0.0, 1.0) * 1e12 + req.qkey[unfinished]
        req.qkey[unfinished[np.argsort(carried_first, kind="stable")]] = np.arange(
            unfinished.size, dtype=float
        )
        old_rep, old_ratio = req.rep[running], max(self.mem.ratio)
        self.layout, self.mem = sw.layout, self._admission(sw.layout)
        req.rep[unfinished] = balance(sw.work, unfinished, sw.layout.replicas)
        if self.cfg.admission == "paged":
            # as the engine's switch: the new replicas start from the old ones' largest new-token ratio,
            # and the carried requests that its placement keeps running run at once, without a prefill
            self.mem.ratio = [old_ratio] * sw.layout.replicas
            slots = running[np.lexsort((req.seq[running], old_rep))]  # old replica, then slot order
            for d in range(sw.layout.replicas):
                self.mem.carry(req, d, slots[req.rep[slots] == d])
        self._reset_replicas(t0 + ms, int(self._steps.max()))
        self.timeline.append(((t0 + ms) / 1e3, int(unfinished.size), sw.layout.tp))
        if controller is not None:
            controller.switched(self, t0 + ms)
