"""The planner loop: every tick, for every pod, read its state, decide (``tick``), push the plan, and record
decisions and their outcomes. It talks to pods only over HTTP, through a ``PodLink``: straight to an engine
server (service mode, tests) or to a pod's sidecar (``rolloutctl run``, the operator).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import PlannerPolicy
from rollout_profiler.planning.predictor import Prior
from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.state import EngineState

from rollout_operator.control.tick import PodMemory, TickResult, tick

log = logging.getLogger(__name__)


class PodLink(Protocol):
    name: str

    async def state(self, since_step: int) -> tuple[EngineState, int]:
        """The engine's state and how many of the pod's samples are not yet submitted."""
        ...

    async def push(self, plan: Plan) -> bool:
        """PUT the plan; False when the engine's layout changed meanwhile (409)."""
        ...

    async def events(self) -> list[ReconfigEvent]: ...


@dataclass
class EngineLink:
    """A pod reached at its engine server's port (service mode: nothing left to submit)."""

    name: str
    url: str
    key: str | None = None
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10.0)

    async def state(self, since_step: int) -> tuple[EngineState, int]:
        r = await self.client.get("/v1/state", params={"since_step": since_step})
        r.raise_for_status()
        return EngineState.model_validate(r.json()), 0

    async def push(self, plan: Plan) -> bool:
        r = await self.client.put("/v1/plan", json=plan.model_dump(mode="json"))
        if r.status_code == 409:
            return False
        r.raise_for_status()
        return True

    async def events(self) -> list[ReconfigEvent]:
        r = await self.client.get("/v1/reconfigurations")
        r.raise_for_status()
        return [ReconfigEvent.model_validate(e) for e in r.json()]

    async def aclose(self) -> None:
        await self.client.aclose()


class Recorder(Protocol):
    def decided(self, pod: str, result: TickResult) -> int | None: ...

    def switched(self, pod: str, decision_id: int | None, event: ReconfigEvent) -> None: ...


@dataclass
class Outcome:
    """What one tick did on one pod (for progress displays and reports)."""

    pod: str
    result: TickResult
    pushed: bool
    new_events: list[ReconfigEvent]


class PlannerLoop:
    def __init__(
        self,
        links: list[PodLink],
        model: LatencyModel,
        policy: PlannerPolicy,
        prior: Prior | None = None,
        recorder: Recorder | None = None,
        interval_s: float = 0.25,
    ) -> None:
        self.links, self.model, self.policy, self.prior = links, model, policy, prior
        self.recorder, self.interval_s = recorder, interval_s
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
        result = tick(state, mem, self.model, self.policy, self.prior, not_submitted)
        pushed = False
        if result.plan is not None and not state.reconfiguring:
            pushed = await link.push(result.plan)
            if pushed:
                decision_id = self.recorder.decided(link.name, result) if self.recorder is not None else None
                self.pending[link.name].append(decision_id)
                self.pending[link.name] += [None] * (len(result.plan.triggers) - 1)  # the rest of the chain
        return Outcome(link.name, result, pushed, new)

    async def run_once(self) -> list[Outcome]:
        got = await asyncio.gather(*(self.tick_pod(link) for link in self.links))
        return [o for o in got if o is not None]

    async def run(
        self, done: Callable[[], bool], on_tick: Callable[[list[Outcome]], Any] | None = None
    ) -> None:
        """Tick until ``done()``; a final tick records the switches that ran since the last one."""
        while not done():
            outcomes = await self.run_once()
            if on_tick is not None:
                on_tick(outcomes)
            await asyncio.sleep(self.interval_s)
        await self.run_once()
