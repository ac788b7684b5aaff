"""How the planner loop reaches a pod, over HTTP only: straight at its engine server (``EngineLink``: tests,
a bare ``rolloutctl serve``) or through its sidecar (``SidecarLink``: ``rolloutctl run`` and the operator),
which reads state on the sidecar's API port and sends plans to its admin port."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.sidecar import Progress, SidecarState
from rollout_worker.api.state import EngineState


class PodLink(Protocol):
    name: str

    async def state(self, since_step: int) -> tuple[EngineState, int]:
        """The engine's state and how many of the pod's samples are not yet submitted."""
        ...

    async def push(self, plan: Plan) -> bool:
        """PUT the plan; False when the engine's layout changed meanwhile (409)."""
        ...

    async def events(self) -> list[ReconfigEvent]: ...


def _client(token: str | None, timeout_s: float, **kw: Any) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(headers=headers, timeout=timeout_s, **kw)


async def _push(client: httpx.AsyncClient, url: str, plan: Plan) -> bool:
    r = await client.put(url, json=plan.model_dump(mode="json"))
    if r.status_code == 409:
        return False
    r.raise_for_status()
    return True


async def _events(client: httpx.AsyncClient, url: str) -> list[ReconfigEvent]:
    r = await client.get(url)
    r.raise_for_status()
    return [ReconfigEvent.model_validate(e) for e in r.json()]


@dataclass
class EngineLink:
    """A pod reached at its engine server's port (nothing left to submit)."""

    name: str
    url: str
    key: str | None = None
    timeout_s: float = 10.0
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = _client(self.key, self.timeout_s)

    async def state(self, since_step: int) -> tuple[EngineState, int]:
        r = await self.client.get(self.url + "/v1/state", params={"since_step": since_step})
        r.raise_for_status()
        return EngineState.model_validate(r.json()), 0

    async def push(self, plan: Plan) -> bool:
        return await _push(self.client, self.url + "/v1/plan", plan)

    async def events(self) -> list[ReconfigEvent]:
        return await _events(self.client, self.url + "/v1/reconfigurations")

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass
class SidecarLink:
    """A pod reached through its sidecar: state on the API port, plans on the admin port."""

    name: str
    api: str
    admin: str
    token: str
    timeout_s: float = 10.0
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = _client(self.token, self.timeout_s)

    async def state(self, since_step: int) -> tuple[EngineState, int]:
        r = await self.client.get(self.api + "/v1/state", params={"since_step": since_step})
        r.raise_for_status()
        got = SidecarState.model_validate(r.json())
        return got.engine, got.not_submitted.samples

    async def push(self, plan: Plan) -> bool:
        return await _push(self.client, self.admin + "/v1/plan", plan)

    async def events(self) -> list[ReconfigEvent]:
        return await _events(self.client, self.api + "/v1/reconfigurations")

    async def progress(self) -> Progress:
        r = await self.client.get(self.api + "/v1/progress")
        r.raise_for_status()
        return Progress.model_validate(r.json())

    async def aclose(self) -> None:
        await self.client.aclose()
