"""How the sidecar's routes answer when the engine behind them fails: no answer at all is a 503 naming it;
an error answer from the engine is passed on with the engine's own status and body (one app-level handler
each, for every route that talks to the engine)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from rollout_worker.sidecar.app import create_admin_app, create_api_app
from rollout_worker.sidecar.engine_client import EngineAnswer, EngineUnreachable

TOKEN = "t0ken"
ENGINE_409 = {"error": {"message": "plan is based on 2x1, the engine is at 1x2", "field": "based_on_layout"}}


class _Client:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def call(self, method: str, path: str) -> Any:
        raise self.exc

    async def forward(self, method: str, path: str, body: Any, timeout: float) -> Any:
        raise self.exc


def _side(exc: Exception) -> Any:
    async def state(since_step: int) -> Any:
        raise exc

    return SimpleNamespace(
        token=TOKEN, settings=SimpleNamespace(max_body_bytes=1 << 20), client=_Client(exc), state=state
    )


async def _request(app: Any, method: str, path: str, body: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
        return await c.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})


def _get(app: Any, method: str, path: str, body: Any = None) -> httpx.Response:
    return asyncio.run(_request(app, method, path, body))


ROUTES = [("api", "GET", "/v1/state", None), ("api", "GET", "/v1/reconfigurations", None)]
PLAN = {"based_on_layout": "2x1", "triggers": []}


@pytest.mark.parametrize(("which", "method", "path", "body"), [*ROUTES, ("admin", "PUT", "/v1/plan", PLAN)])
def test_no_answer_from_the_engine_is_a_503(which: str, method: str, path: str, body: Any) -> None:
    side = _side(EngineUnreachable("connection refused"))
    app = create_api_app(side) if which == "api" else create_admin_app(side)
    r = _get(app, method, path, body)
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "engine unreachable: connection refused"


@pytest.mark.parametrize(("which", "method", "path", "body"), ROUTES)
def test_the_engines_error_answer_is_passed_on(which: str, method: str, path: str, body: Any) -> None:
    r = _get(create_api_app(_side(EngineAnswer(409, ENGINE_409))), method, path, body)
    assert r.status_code == 409 and r.json() == ENGINE_409
