"""Running the server: uvicorn, with SIGTERM / Ctrl-C handled the way a pod needs it."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Any

import uvicorn

from rollout_worker.engine.config import EngineConfig
from rollout_worker.proc import listen
from rollout_worker.server.app import create_app
from rollout_worker.server.settings import ServerSettings

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """On SIGTERM or Ctrl-C, first end the requests in flight (drain for ``drain_seconds``, then abort:
    their clients get partial outputs with finish_reason abort), so open streams close and the graceful
    shutdown is quick; then stop every rank."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.app_state = app.state.server

    def handle_exit(self, sig: int, frame: Any) -> None:
        engine = self.app_state.engine
        if not self.should_exit:
            n = engine.snapshot().unfinished if engine is not None else 0
            log.info("received %s: stopping (%d request(s) in flight)", signal.Signals(sig).name, n)
        if engine is not None and not self.should_exit:
            drain = self.app_state.settings.drain_seconds
            threading.Thread(target=engine.shutdown, args=(drain,), name="drain", daemon=True).start()
        super().handle_exit(sig, frame)


def serve(settings: ServerSettings, cfg: EngineConfig, corpus: list[str] | None = None) -> int:
    """Serve until stopped; the exit code is 1 when the engine failed (a rank died), else 0.

    The socket is bound first: a taken port or a bad host is a UserError (exit 2, one line) before the
    tokenizer loads or a rank starts, so nothing is left to stop. ``corpus``: documents speculative decoding
    drafts from, added once the engine is ready."""
    sock = listen(settings.host, settings.port)
    try:
        return _serve(settings, cfg, sock, corpus or [])
    finally:
        sock.close()


def _serve(settings: ServerSettings, cfg: EngineConfig, sock: socket.socket, corpus: list[str]) -> int:
    app = create_app(settings, cfg, corpus=corpus)
    config = uvicorn.Config(
        app,
        log_level="info",
        access_log=settings.access_log,
        timeout_graceful_shutdown=max(5, int(settings.drain_seconds) + 5),
        lifespan="on",
    )
    server = _Server(config, app)
    state = app.state.server

    def request_exit(code: int) -> None:
        log.info("stopping with exit code %d", code)
        state.exit_code = code
        server.should_exit = True

    state.request_exit = request_exit
    # uvicorn handles SIGINT/SIGTERM while it runs and re-raises them after its graceful shutdown; that
    # shutdown is the whole answer to the signal, so the re-raised one must not turn into an error exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log.info("serving on http://%s (the engine starts meanwhile: /health is 503 until ready)", where)
    server.run(sockets=[sock])
    return state.exit_code or 0
