"""One planner tick for one pod, as pure functions: the pod's state -> the planner's snapshot -> a decision
-> the plan to push (or none). The one home of this decision: the operator's planner loop (``rolloutctl run``
and the cluster, ``rollout_operator.control.planner_loop``) and the simulator's adaptive controller
(``rollout_profiler.sim.policies``) both call :func:`tick` on an :class:`EngineState`, so a simulated
result is what the operator would do.

Hysteresis lives in :func:`~rollout_profiler.planning.planner.decide`; what the tick adds is the pod's
memory (:class:`PodMemory`): the cooldown runs from the last *committed* switch the engine reported (its
step and time, so the switch's own duration does not count), and a new wave (requests the pod did not know
at its last switch, new weights, or before any switch a queue of requests that never ran) lets a
consolidated pod shrink its TP size even when the policy does not. Requests back in the queue are no
wave: a retraction for want of KV pages, or a switch, moves a request from running to waiting, and the work
the pod knows stays what it was.

The job's finished lengths accumulate across ticks (``state.finished`` since the previous step), and with
the prior from earlier jobs of the model they fit the remaining-length predictor. A plan is pushed only on a
``switch`` decision, whose predicted gain passed the hysteresis (``gain > cost x (1 + margin) + min
gain``); its first trigger sits at the current unfinished count, so the engine switches at its next step
report, and later triggers of the chain fire at the steps the planner predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.state import EngineState, WaitingRequest
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import Decision, decide
from rollout_profiler.planning.policy import LastSwitch, PlannerPolicy, PodSnapshot, ReplicaState
from rollout_profiler.planning.predictor import LengthPredictor, Prior, fit


@dataclass
class PodMemory:
    """What the loop remembers of one pod between ticks."""

    since_step: int = 0
    lengths: list[int] = field(default_factory=list)  # finished lengths of this job on this pod
    capped: list[bool] = field(default_factory=list)
    last_switch: LastSwitch | None = None
    events_seen: int = 0
    weights: tuple[str, int] | None = None  # the engine's weight version and loads at the last tick
    new_iteration: bool = False  # the weights changed (the next RL iteration) since the last switch
    known_at_switch: int | None = None  # requests known at the last switch (None: the next tick's count)

    def absorb(self, state: EngineState) -> None:
        self.lengths += state.finished.lengths
        self.capped += state.finished.capped
        self.since_step = state.step
        weights = (state.weight_version, state.weight_loads)  # renamed, or loaded under the same name
        if self.weights is not None and weights != self.weights:
            self.new_iteration = True
        self.weights = weights

    def note_events(self, events: list[ReconfigEvent]) -> list[ReconfigEvent]:
        """New switch events since the last call; the last committed one starts the cooldown."""
        new = events[self.events_seen :]
        self.events_seen = len(events)
        for ev in new:
            if ev.outcome == "committed":
                took = ev.actual_ms if ev.actual_ms is not None else ev.predicted_ms
                self.last_switch = LastSwitch(ev.step, ev.time_s, took / 1e3)
                self.new_iteration = False
                self.known_at_switch = None
        return new

    def arrived(self, known: int) -> int:
        """Requests that arrived since the last switch (or the first tick), of the ``known`` now."""
        if self.known_at_switch is None:
            self.known_at_switch = known
        return max(0, known - self.known_at_switch)


def _waiting(state: EngineState) -> list[WaitingRequest]:
    """Every request the engine holds but does not run: in a replica's queue, or not given one yet."""
    return [w for r in state.replicas for w in r.waiting] + list(state.queued)


def _fresh(state: EngineState, not_submitted: int) -> bool:
    """Requests wait that never ran (not retracted nor moved by a switch: those keep their tokens)."""
    return not_submitted > 0 or any(w.generated == 0 for w in _waiting(state))


def known_requests(state: EngineState, not_submitted: int = 0) -> int:
    """Every request the pod knows of: finished, running, waiting or queued in the engine, and the ones its
    sidecar has not submitted yet. A retraction or a switch moves requests between these, never adds one."""
    held = sum(len(r.running) for r in state.replicas) + len(_waiting(state))
    return state.finished.total + held + max(0, not_submitted)


def snapshot(state: EngineState, not_submitted: int = 0) -> PodSnapshot:
    """The planner's view of an engine state. Requests the engine holds but has not given a replica count as
    waiting, one by one, and the prompts the pod has not submitted yet by number (both dealt over the
    replicas)."""
    reps = []
    extra = max(0, not_submitted)
    n = max(len(state.replicas), 1)
    for d, r in enumerate(state.replicas):
        wait = r.waiting + state.queued[d::n]
        reps.append(
            ReplicaState(
                prompt_len=np.array([x.prompt_len for x in r.running], dtype=float),
                generated=np.array([x.generated for x in r.running], dtype=float),
                cap=np.array([x.max_new_tokens for x in r.running], dtype=float),
                waiting=extra // n + (d < extra % n),
                wait_prompt_len=np.array([x.prompt_len for x in wait], dtype=float),
                wait_generated=np.array([x.generated for x in wait], dtype=float),
                wait_cap=np.array([x.max_new_tokens for x in wait], dtype=float),
            )
        )
    waiting = _waiting(state)
    wprompt = int(np.mean([w.prompt_len for w in waiting])) if waiting else 256
    wcap = max((w.max_new_tokens for w in waiting), default=None)
    return PodSnapshot(
        state.layout, tuple(reps), tuple(state.ranks_ready), state.step, state.time_s, wprompt, wcap
    )


def predictor(memory: PodMemory, snap: PodSnapshot, prior: Prior | None) -> LengthPredictor:
    lengths = np.array(memory.lengths, dtype=float)
    caps = np.where(np.array(memory.capped, dtype=bool), lengths, np.inf) if memory.lengths else None
    reps = snap.replicas  # every unfinished request it knows one by one is still running at its length
    current = np.concatenate([x for r in reps for x in (r.generated, r.wait_generated)] or [np.zeros(0)])
    cur_caps = np.concatenate([x for r in reps for x in (r.cap, r.wait_cap)] or [np.zeros(0)])
    return fit(lengths, current, cur_caps, caps, prior)


@dataclass(frozen=True)
class TickResult:
    decision: Decision
    plan: Plan | None  # to push (PUT /v1/plan), based on the current layout
    inputs: dict[str, Any]  # what the planner saw, for the decision record


def tick(
    state: EngineState,
    memory: PodMemory,
    model: LatencyModel,
    policy: PlannerPolicy,
    prior: Prior | None,
    not_submitted: int = 0,
) -> TickResult:
    """Decide for one pod. ``memory`` must already have absorbed ``state``'s finished lengths."""
    snap = snapshot(state, not_submitted)
    waiting = sum(r.waiting + len(r.wait_generated) for r in snap.replicas)
    running = sum(len(r.generated) for r in snap.replicas)
    # a new wave on a consolidated pod (requests it did not know at its last switch, or new weights: the
    # next RL iteration; before any switch, a queue of requests that never ran) may move back toward
    # throughput; requests retracted back to the queue may not
    arrived = memory.arrived(known_requests(state, not_submitted))
    wave = (
        arrived > 0 or memory.new_iteration or (memory.last_switch is None and _fresh(state, not_submitted))
    )
    pol = policy if not wave or policy.allow_shrink else replace(policy, allow_shrink=True)
    pred = predictor(memory, snap, prior)
    decision = decide(model, snap, pol, pred, memory.last_switch)
    inputs = {
        "layout": str(state.layout),
        "step": state.step,
        "running": running,
        "waiting": waiting,
        "finished": len(memory.lengths),
        "step_ms": state.step_ms,
        "predictor": pred.source,
        "new_wave": wave,
        "reason": decision.reason,
    }
    in_engine = running + sum(len(r.wait_generated) for r in snap.replicas)  # what the engine fires plans by
    return TickResult(decision, _plan_to_push(state, decision, in_engine), inputs)


def _plan_to_push(state: EngineState, decision: Decision, unfinished: int) -> Plan | None:
    """A ``switch`` decision's plan; or, when the engine holds a plan for its layout whose triggers the
    planner would no longer set (its predictions moved on, a cooldown runs), that plan refreshed: the
    later triggers of a pushed chain never fire on a stale prediction. A held plan with a trigger due
    stands: the engine fires it at its next step, and a tick landing in between neither takes back the
    decision that pushed it nor pushes it twice."""
    held = state.plan
    if held is not None and held.based_on_layout == state.layout:
        due, _ = held.fire(unfinished, state.layout)
        if due is not None:
            return None
    fresh = Plan(based_on_layout=state.layout, triggers=list(decision.plan))
    if decision.action == "switch":
        return fresh if decision.plan else None
    if held is None or held.based_on_layout != state.layout or _switches(held) == _switches(fresh):
        return None
    return fresh


def _switches(plan: Plan) -> list[tuple[int, Layout, str]]:
    """What a plan would do (its predictions of steps and costs aside)."""
    return [(t.unfinished_at_most, t.layout, t.method) for t in plan.triggers]
