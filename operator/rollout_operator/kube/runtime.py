"""What the operator holds in memory for one running job: links to its pods' sidecars (by pod uid), the
planner loop with its per-pod memory, and since when each sidecar has not answered. It is rebuilt from the
job's status after an operator restart (each pod's last engine step and switch count), so nothing is
recorded twice; the finished lengths seen before the restart are not kept (the predictor starts again
from the database's prior)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import httpx
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.planning.tick import PodMemory
from rollout_worker.api.sidecar import Progress

from rollout_operator.api import cluster as k
from rollout_operator.api.status import RolloutJobStatus
from rollout_operator.cluster.decisions import PodTick
from rollout_operator.cluster.reconcile import PodView
from rollout_operator.control.links import SidecarLink
from rollout_operator.control.planner_loop import PlannerLoop, Recorder


@dataclass
class JobRuntime:
    token: str
    loop: PlannerLoop | None  # None: a static job with no profile (progress only, no planner)
    timeout_s: float
    links: dict[int, tuple[str, SidecarLink]] = field(default_factory=dict)  # index -> (pod uid, link)
    away_since: dict[int, float] = field(default_factory=dict)
    awaiting_switch: set[str] = field(default_factory=set)  # pods with a pushed plan not yet seen running

    @classmethod
    def start(
        cls,
        token: str,
        status: RolloutJobStatus,
        model: LatencyModel | None,
        policy: PlannerPolicy,
        prior: Prior | None,
        recorder: Recorder | None,
        timeout_s: float,
    ) -> JobRuntime:
        loop = PlannerLoop([], model, policy, prior, recorder) if model is not None else None
        rt = cls(token, loop, timeout_s)
        for p in status.pods:  # carry on where the last operator stopped with these pods
            if p.uid:
                if loop is not None:
                    loop.memory[p.name] = PodMemory(since_step=p.step, events_seen=p.reconfigurations)
                rt.links[p.index] = (p.uid, rt._link(p.name, p.ip or "0.0.0.0"))
        return rt

    def _link(self, name: str, ip: str) -> SidecarLink:
        return SidecarLink(
            name, f"http://{ip}:{k.SIDECAR_PORT}", f"http://{ip}:{k.ADMIN_PORT}", self.token, self.timeout_s
        )

    async def _relink(self, pods: dict[int, PodView]) -> None:
        """Links follow the pods: a new pod (new uid, new address) gets a new link and a fresh engine memory
        (its engine counts steps and switches from zero); the job's finished lengths stay."""
        for i, view in pods.items():
            old = self.links.get(i)
            if view.ip is None or view.deleting or view.phase != "Running":
                continue
            if old is not None and old[0] == view.uid and old[1].api.startswith(f"http://{view.ip}:"):
                continue
            if old is not None:
                await old[1].aclose()
            if (old is None or old[0] != view.uid) and self.loop is not None:
                mem = self.loop.memory.get(view.name) or PodMemory()
                self.loop.memory[view.name] = PodMemory(lengths=mem.lengths, capped=mem.capped)
                self.loop.pending[view.name] = []
            self.awaiting_switch.discard(view.name)
            self.links[i] = (view.uid, self._link(view.name, view.ip))

    async def poll(self, pods: dict[int, PodView]) -> dict[int, Progress]:
        """Each running pod's progress; a sidecar that does not answer is counted as away."""
        await self._relink(pods)
        running = {i: link for i, (_, link) in self.links.items() if i in pods and pods[i].phase == "Running"}

        async def one(link: SidecarLink) -> Progress | None:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                return await link.progress()
            return None

        got = await asyncio.gather(*(one(link) for link in running.values()))
        now = time.monotonic()
        out = {}
        for i, prog in zip(running, got, strict=True):
            if prog is None:
                self.away_since.setdefault(i, now)
            else:
                self.away_since.pop(i, None)
                out[i] = prog
        for i in list(self.away_since):
            if i not in running:  # no pod to reach: not the sidecar's fault
                del self.away_since[i]
        return out

    def unreachable_s(self) -> dict[int, float]:
        now = time.monotonic()
        return {i: now - t for i, t in self.away_since.items()}

    async def plan(self, reachable: dict[int, Progress]) -> list[PodTick]:
        """One planner tick on every pod whose sidecar answered: read its state, decide, push a plan."""
        loop = self.loop
        if loop is None:
            return []
        links = [self.links[i][1] for i in reachable]

        async def one(link: SidecarLink) -> PodTick | None:
            mem = loop.memory.setdefault(link.name, PodMemory())
            loop.pending.setdefault(link.name, [])
            loop.failures.setdefault(link.name, 0)
            before = len(mem.lengths)
            out = await loop.tick_pod(link)
            if out is None:
                return None
            if out.pushed:
                self.awaiting_switch.add(link.name)
            if out.new_events:
                self.awaiting_switch.discard(link.name)
            return PodTick(out, mem.since_step, sum(mem.lengths[before:]))

        got = await asyncio.gather(*(one(link) for link in links))
        return [t for t in got if t is not None]

    def lengths(self) -> tuple[list[int], list[bool]]:
        lengths: list[int] = []
        capped: list[bool] = []
        for mem in self.loop.memory.values() if self.loop is not None else []:
            lengths += mem.lengths
            capped += mem.capped
        return lengths, capped

    async def close(self) -> None:
        for _, link in self.links.values():
            await link.aclose()
