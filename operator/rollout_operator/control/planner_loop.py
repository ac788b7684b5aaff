"""The planner loop: every tick, for every pod, read its state, decide (the pure
:func:`rollout_profiler.planning.tick.tick`, which the simulator runs too), push the plan, and record
decisions and their outcomes. It talks to pods only over HTTP, through a ``PodLink`` (``links``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import httpx
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.planning.tick import PodMemory, TickResult, tick
from rollout_worker.api.plan import ReconfigEvent

from rollout_operator.control.links import PodLink

log = logging.getLogger(__name__)


class Recorder(Protocol):
    def decided(self, pod: str, result: TickResult) -> int | None: ...

    def switched(self, pod: str, decision_id: int | None, event: ReconfigEvent) -> None: ...

    def superseded(self, decision_id: int) -> None: ...

    def lengths(self, lengths: list[int], capped: list[bool]) -> None: ...


@dataclass
class Outcome:
    """What one tick did on one pod (for progress displays and reports)."""

    pod: str
    result: TickResult
    pushed: bool  # a switch decision's plan was pushed (a refreshed plan is not a decision)
    new_events: list[ReconfigEvent]


class PlannerLoop:
    def __init__(
        self,
        links: list[PodLink],
        model: LatencyModel,
        policy: PlannerPolicy,
        prior: Prior | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.links, self.model, self.policy, self.prior = links, model, policy, prior
        self.recorder = recorder
        self.memory = {link.name: PodMemory() for link in links}
        self.pending: dict[str, list[int | None]] = {link.name: [] for link in links}
        self.failures: dict[str, int] = {link.name: 0 for link in links}

    async def tick_pod(self, link: PodLink) -> Outcome | None:
        mem = self.memory[link.name]
        try:
            state, not_submitted = await link.state(mem.since_step)
            events = await link.events()
        except (httpx.HTTPError, ValueError) as exc:  # unreachable for a while: skip, retry next tick
            self.failures[link.name] += 1
            log.warning("pod %s: state unavailable (%s)", link.name, exc)
            return None
        self.failures[link.name] = 0
        mem.absorb(state)
        new = mem.note_events(events)
        for ev in new:
            decision_id = self.pending[link.name].pop(0) if self.pending[link.name] else None
            if self.recorder is not None:
                self.recorder.switched(link.name, decision_id, ev)
        try:
            result = tick(state, mem, self.model, self.policy, self.prior, not_submitted)
        except Exception as exc:  # a planner bug must not stop the pods: no plan this tick, the error logged
            log.warning("pod %s: the planner failed on this state (%r); no plan this tick", link.name, exc)
            log.debug("the planner's traceback", exc_info=True)
            self.failures[link.name] += 1
            return None
        pushed = False
        if result.plan is not None and not state.reconfiguring and await link.push(result.plan):
            # the pushed plan replaces the one the engine held: its switches are the ones to come, and a
            # decision whose switch had not run yet never will
            for unfired in self.pending[link.name]:
                if unfired is not None and self.recorder is not None:
                    self.recorder.superseded(unfired)
            later: list[int | None] = [None] * max(len(result.plan.triggers) - 1, 0)
            if result.decision.action == "switch":
                pushed = True
                decision_id = self.recorder.decided(link.name, result) if self.recorder is not None else None
                self.pending[link.name] = [decision_id, *later]  # the rest of the chain: later triggers
            else:  # the held plan refreshed (tick: a later trigger the planner would no longer set)
                self.pending[link.name] = [None] * len(result.plan.triggers)
        return Outcome(link.name, result, pushed, new)

    async def run_once(self) -> list[Outcome]:
        got = await asyncio.gather(*(self.tick_pod(link) for link in self.links))
        return [o for o in got if o is not None]
