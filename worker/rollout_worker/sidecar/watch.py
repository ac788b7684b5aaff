"""Watching the engine: its health, planner snapshot and throughput, read every ``poll_seconds``.

The sidecar answers ``/v1/progress`` and ``/readyz`` from the last snapshot (no engine round trip), and job
mode sends samples only while the engine is healthy. An engine that never becomes healthy within
``engine_wait_seconds``, or that stops answering for ``engine_timeout_seconds`` once it has served, ends
the sidecar with :class:`EngineLost`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import ValidationError

from rollout_worker.api.state import EngineState
from rollout_worker.errors import EngineError
from rollout_worker.sidecar.engine_client import EngineAnswer, EngineClient, EngineUnreachable

log = logging.getLogger(__name__)


class EngineLost(EngineError):
    """The engine did not become healthy in time, or stopped answering for too long."""


class EngineWatch:
    def __init__(self, client: EngineClient, poll_s: float, wait_s: float, timeout_s: float) -> None:
        self.client, self.poll_s, self.wait_s, self.timeout_s = client, poll_s, wait_s, timeout_s
        self.state: EngineState | None = None
        self.state_at: float | None = None  # monotonic time of the last snapshot
        self.tokens_per_s = 0.0
        self.problem = "engine not polled yet"
        self.healthy = asyncio.Event()
        self.started = time.monotonic()
        self.last_ok: float | None = None

    @property
    def ready(self) -> bool:
        return self.healthy.is_set()

    def lost(self, why: str) -> None:
        """A caller could not reach the engine: stop sending until a poll finds it healthy again."""
        if self.healthy.is_set():
            log.warning("engine at %s: %s; waiting for it", self.client.url, why)
        self.problem = why
        self.healthy.clear()

    async def wait_healthy(self) -> None:
        await self.healthy.wait()

    async def poll(self) -> bool:
        """One poll; True when the engine is healthy and its state was read."""
        try:
            ok, why = await self.client.health()
            if not ok:
                self.lost(why)
                return False
            raw = await self.client.state(self.state.step if self.state else 0)
            self.state, self.state_at = EngineState.model_validate(raw), time.monotonic()
            self.tokens_per_s = await self.client.throughput() or 0.0
        except EngineUnreachable as exc:
            self.lost(f"unreachable ({exc})")
            return False
        except EngineAnswer as exc:
            self.lost(f"/v1/state answered {exc}")
            return False
        except ValidationError as exc:
            self.lost(f"/v1/state is not an engine state ({exc.error_count()} error(s))")
            return False
        if not self.healthy.is_set():
            log.info("engine at %s is healthy (layout %s)", self.client.url, self.state.layout)
        self.last_ok = time.monotonic()
        self.problem = ""
        self.healthy.set()
        return True

    async def run(self) -> None:
        """Poll until cancelled; raises EngineLost past the deadline."""
        while True:
            ok = await self.poll()
            now = time.monotonic()
            if not ok:
                if self.last_ok is None and now - self.started > self.wait_s:
                    raise EngineLost(
                        f"engine at {self.client.url} not healthy after {self.wait_s:g} s: {self.problem}"
                    )
                if self.last_ok is not None and now - self.last_ok > self.timeout_s:
                    raise EngineLost(
                        f"engine at {self.client.url} unreachable or unhealthy for {self.timeout_s:g} s: "
                        f"{self.problem}"
                    )
            await asyncio.sleep(self.poll_s)
