"""The sidecar's one way to the engine: its HTTP API (SGLang's ``/generate``, ``/health``, ``/metrics`` and
the planner's ``/v1/state``, ``/v1/plan``, ``/v1/reconfigure``), with the engine's API key."""

from __future__ import annotations

from typing import Any

import httpx

from rollout_worker.api.sglang import GenerateRequest


class EngineUnreachable(Exception):
    """No HTTP answer from the engine (refused, reset, timed out)."""


class EngineAnswer(Exception):
    """The engine answered with an error status; ``body`` is its JSON (``{"error": {...}}``)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {_message(body)}")
        self.status, self.body = status, body

    @property
    def field(self) -> str | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err.get("field") if isinstance(err, dict) else None


def _message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:200]


class EngineClient:
    def __init__(self, url: str, key: str | None, max_connections: int) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            # generation has no read timeout (long samples); every other call gets `timeout` per request
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(
                max_connections=max_connections + 8, max_keepalive_connections=max_connections
            ),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def request(
        self, method: str, path: str, timeout: float | None = 30.0, **kw: Any
    ) -> httpx.Response:
        try:
            return await self.http.request(method, path, timeout=httpx.Timeout(timeout, connect=5.0), **kw)
        except httpx.TransportError as exc:
            raise EngineUnreachable(f"{type(exc).__name__}: {exc or 'no answer'}") from None

    async def call(self, method: str, path: str, timeout: float | None = 30.0, **kw: Any) -> Any:
        """The JSON of a 2xx answer; EngineAnswer for any other status."""
        r = await self.request(method, path, timeout, **kw)
        body = _json(r)
        if not 200 <= r.status_code < 300:
            raise EngineAnswer(r.status_code, body)
        return body

    async def health(self) -> tuple[bool, str]:
        """(healthy, why not)."""
        r = await self.request("GET", "/health", timeout=10.0)
        if r.status_code == 200:
            return True, "ok"
        return False, f"engine /health answered {r.status_code}: {_message(_json(r))}"

    async def state(self, since_step: int = 0) -> Any:
        return await self.call("GET", "/v1/state", params={"since_step": since_step})

    async def throughput(self) -> float | None:
        """``sglang:gen_throughput`` (generated tokens per second, last 10 s) from the engine's metrics."""
        r = await self.request("GET", "/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        for line in r.text.splitlines():
            if line.startswith("sglang:gen_throughput"):
                try:
                    return float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    return None
        return None

    async def generate(self, body: GenerateRequest) -> Any:
        """``POST /generate`` with the fields the body was given (SGLang's defaults fill the rest)."""
        return await self.call("POST", "/generate", timeout=None, json=body.model_dump(exclude_unset=True))

    async def forward(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, Any]:
        """(status, JSON) of the engine's answer, whatever the status (passed through to the caller)."""
        r = await self.request(method, path, timeout, json=body)
        return r.status_code, _json(r)


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": f"engine answered {r.status_code} with no JSON body", "code": 502}}
