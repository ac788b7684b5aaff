"""What the routes share: the server's state, reached from a request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from rollout_worker.data.prompts import ChatTemplate
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.engine import Engine
from rollout_worker.engine.model.tokenizer import TextCodec
from rollout_worker.errors import Unavailable
from rollout_worker.server.bridge import AsyncEngine
from rollout_worker.server.metrics import Metrics
from rollout_worker.server.settings import ServerSettings
from rollout_worker.server.tensor_update import Staging


@dataclass
class ServerState:
    settings: ServerSettings
    cfg: EngineConfig
    codec: TextCodec | None
    metrics: Metrics
    bridge: AsyncEngine = field(default_factory=AsyncEngine)
    engine: Engine | None = None
    weights_path: Path | None = None  # the checkpoint being served (None: --model)
    staging: Staging = field(default_factory=Staging)  # checkpoints made of tensors a trainer sent
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one weight update at a time
    chat: ChatTemplate | None = None  # the model's chat template (None: it has none, or it does not parse)
    exit_code: int | None = None
    loading: str | None = None  # what the server loads before it serves (an external corpus): /health 503
    request_exit: Callable[[int], None] = lambda code: None

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or str(self.settings.model)

    @property
    def weights_root(self) -> Path:
        return (self.settings.weights_root or Path(self.settings.model)).resolve()

    @property
    def served_weights(self) -> Path:
        return self.weights_path or Path(self.settings.model)

    async def serve_staged(self, staged: Path, load: Callable[[], int]) -> int:
        """Run ``load`` (an engine weight update of the staged checkpoint) in a worker thread: the staged
        checkpoint is served from then on, or forgotten when the load fails. Call under ``weights_lock``."""
        current = self.served_weights
        try:
            waited = await self.bridge.call(load)
        except BaseException:
            self.staging.forget_except(current)
            raise
        self.weights_path = staged
        self.staging.forget_except(staged)
        return waited

    def ready_engine(self) -> Engine:
        if self.engine is None:
            raise Unavailable("engine is starting")
        return self.engine


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


class FastJSON(JSONResponse):
    """JSON bodies encoded with orjson (generation responses carry long id and logprob lists)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
