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

from fastapi import FastAPI, Request
from fastapi.responses import Response

from rollout_worker import __version__
from rollout_worker.data.prompts import ChatTemplate
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.engine import Engine
from rollout_worker.engine.messages import Faults
from rollout_worker.engine.model.tokenizer import TextCodec
from rollout_worker.errors import EngineError, UserError
from rollout_worker.server.deps import ServerState
from rollout_worker.server.metrics import Metrics
from rollout_worker.server.routes import absent, chat, control, generate, info, openai, planner, weight_sync
from rollout_worker.server.settings import ServerSettings
from rollout_worker.web.errors import ErrorResponse, install_error_handlers
from rollout_worker.web.middleware import ApiKey, BodyLimit

log = logging.getLogger(__name__)


def create_app(
    settings: ServerSettings, cfg: EngineConfig, faults: Faults | None = None, corpus: list[str] | None = None
) -> FastAPI:
    state = ServerState(
        settings,
        cfg,
        TextCodec.load(settings.model),
        Metrics(settings.served_model_name or str(settings.model)),
        chat=_chat_template(settings),
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
        starting = asyncio.create_task(_start(state, engine, corpus or []))
        try:
            yield
        finally:
            starting.cancel()
            await asyncio.to_thread(engine.shutdown, settings.drain_seconds)
            state.staging.close()

    app = FastAPI(
        title="elastic-rollout engine",
        version=__version__,
        description="SGLang-compatible generation with live tensor-parallel reconfiguration.",
        lifespan=lifespan,
    )
    app.state.server = state
    for module in (generate, control, weight_sync, info, openai, chat, planner, absent):
        app.include_router(module.router)
    install_error_handlers(app, validation_status=400)  # SGLang answers a bad body with 400
    app.add_exception_handler(EngineError, _engine_error)
    if settings.api_key:
        app.add_middleware(ApiKey, key=settings.api_key)
    elif settings.open_to_network:  # allowed by --allow-unauthenticated
        log.warning(
            "no API key and listening on %s: every route, mutating ones included, is open to the network",
            settings.host,
        )
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout=settings.body_timeout_seconds)
    return app


def _chat_template(settings: ServerSettings) -> ChatTemplate | None:
    """The model's chat template for /v1/chat/completions; one that does not parse is logged, not fatal."""
    try:
        return ChatTemplate.of_model(settings.model)
    except Exception as exc:  # jinja2's TemplateSyntaxError, a tokenizer_config.json that is not JSON, ...
        log.warning(
            "the model's chat template cannot be used (/v1/chat/completions will answer 400): %s", exc
        )
        return None


async def _start(state: ServerState, engine: Engine, corpus: list[str]) -> None:
    """Start the engine, then add the external corpus (``/health`` answers 503 until both are done)."""
    path = str(state.settings.speculative_ngram_external_corpus_path)
    if corpus:
        state.loading = f"the external corpus {path}"
    try:
        await asyncio.to_thread(engine.start)
        log.info("engine ready: %d ranks, layout %s", state.cfg.world, engine.layout)
        if corpus and state.codec is not None:  # (the command checked both)
            codec = state.codec
            loaded = await asyncio.to_thread(
                lambda: engine.add_corpus(path, [codec.encode(d) for d in corpus])
            )
            log.info("external corpus %s: %d documents, %d tokens", path, len(corpus), loaded)
        state.loading = None
    except (EngineError, UserError) as exc:
        _fail_soon(state, str(exc))


def _fail_soon(state: ServerState, reason: str) -> None:
    """Answer 503 for a moment (so health checks see it), then exit non-zero."""
    if state.exit_code is not None:
        return
    state.exit_code = 1
    log.error("engine failed: %s; exiting in %.1f s", reason, state.settings.failure_grace_seconds)
    asyncio.get_running_loop().call_later(state.settings.failure_grace_seconds, state.request_exit, 1)


async def _engine_error(request: Request, exc: Exception) -> Response:
    return ErrorResponse(str(exc), None, 503)
