"""The FastAPI application: SGLang's native API, OpenAI completions, and the planner's endpoints.

The engine starts in the background while the server already answers (``/health`` is 503 until every rank
has loaded its weights). If a rank dies, the server answers 503, ends every request in flight with an abort
status, and exits non-zero after a short grace period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollout_worker import __version__
from rollout_worker.api.errors import EngineError, UserError
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver import Engine
from rollout_worker.engine.messages import Faults
from rollout_worker.engine.tokenizer import TextCodec
from rollout_worker.server.deps import ServerState
from rollout_worker.server.metrics import Metrics
from rollout_worker.server.middleware import ApiKey, BodyLimit
from rollout_worker.server.routes import control, generate, info, openai, planner
from rollout_worker.server.settings import ServerSettings

log = logging.getLogger(__name__)


def create_app(settings: ServerSettings, cfg: EngineConfig, faults: Faults | None = None) -> FastAPI:
    state = ServerState(
        settings,
        cfg,
        TextCodec.load(settings.model),
        Metrics(settings.served_model_name or str(settings.model)),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def on_failure(reason: str) -> None:
            loop.call_soon_threadsafe(_fail_soon, state, reason)

        engine = Engine(
            cfg,
            decode=state.codec.decode if state.codec else None,
            listener=state.bridge.listener,
            on_failure=on_failure,
            observer=state.metrics.observer(),
            faults=faults,
        )
        state.bridge.bind(engine, loop)
        state.metrics.engine = engine
        state.engine = engine
        starting = asyncio.create_task(_start(state, engine))
        try:
            yield
        finally:
            starting.cancel()
            await asyncio.to_thread(engine.shutdown, settings.drain_seconds)

    app = FastAPI(
        title="elastic-rollout engine",
        version=__version__,
        description="SGLang-compatible generation with live tensor-parallel reconfiguration.",
        lifespan=lifespan,
    )
    app.state.server = state
    for module in (generate, control, info, openai, planner):
        app.include_router(module.router)
    app.add_exception_handler(UserError, _user_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(EngineError, _engine_error)
    if settings.api_key:
        app.add_middleware(ApiKey, key=settings.api_key)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app


async def _start(state: ServerState, engine: Engine) -> None:
    try:
        await asyncio.to_thread(engine.start)
        log.info("engine ready: %d ranks, layout %s", state.cfg.world, engine.layout)
    except EngineError as exc:
        _fail_soon(state, str(exc))


def _fail_soon(state: ServerState, reason: str) -> None:
    """Answer 503 for a moment (so health checks see it), then exit non-zero."""
    if state.exit_code is not None:
        return
    state.exit_code = 1
    log.error("engine failed: %s; exiting in %.1f s", reason, state.settings.failure_grace_seconds)
    asyncio.get_running_loop().call_later(state.settings.failure_grace_seconds, state.request_exit, 1)


def error_body(message: str, field_name: str | None, code: int) -> dict[str, Any]:
    return {
        "error": {"message": message, "field": field_name, "code": code},
        "object": "error",
        "message": message,
    }


async def _user_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UserError)
    return JSONResponse(error_body(str(exc), exc.field, exc.status), status_code=exc.status)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """400 naming the field, e.g. ``sampling_params.top_p: Input should be less than or equal to 1``."""
    assert isinstance(exc, RequestValidationError)
    err = exc.errors()[0]
    loc = [
        str(x)
        for x in err.get("loc", ())
        if x not in ("body", "query", "path") and not str(x).startswith("function-")
    ]
    loc = [x for x in loc if x not in ("list[SamplingParams]", "SamplingParams", "str", "list[str]")]
    where = ".".join(loc) or "body"
    msg = err.get("msg", "invalid")
    if err.get("type") == "json_invalid":
        where, msg = "body", f"malformed JSON: {err.get('ctx', {}).get('error', msg)}"
    return JSONResponse(error_body(f"{where}: {msg}", where, 400), status_code=400)


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(exc), None, 503), status_code=503)
