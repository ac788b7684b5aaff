"""Running the sidecar: two uvicorn servers (API and admin ports), the engine watch and, in job mode, the job,
in one process and one event loop.

SIGTERM or Ctrl-C (or, with ``exit_with_parent``, the end of the process that started it) stops everything
cleanly and the process exits 0: samples in flight are dropped (the
engine ends their requests when the connection closes; a restarted sidecar sends them again), the file is
closed after any write under way. An engine that never becomes healthy or stops answering for too long
ends the sidecar with :class:`EngineLost` (exit 1, one line); a sample the engine refuses, with UserError.
The sidecar starts no process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from rollout_worker.errors import UserError
from rollout_worker.proc import listen, when_gone
from rollout_worker.sidecar.app import create_admin_app, create_api_app
from rollout_worker.sidecar.deps import Sidecar
from rollout_worker.sidecar.settings import SidecarFields, env_name

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals alone: the sidecar handles them once, for both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int, field: str) -> socket.socket:
    """Listen on ``host:port``; a failure names the variable of ``host`` or of ``field`` (the port's)."""
    try:
        return listen(host, port)
    except UserError as exc:
        raise exc.renamed({"host": env_name("host"), "port": env_name(field)}) from None


def run(settings: SidecarFields) -> int:
    """Build, bind, serve until stopped; 0 after a signal (or once done with ``exit_when_done``)."""
    side = Sidecar.create(settings)
    try:
        socks = [
            bind(settings.host, settings.port, "port"),
            bind(settings.host, settings.admin_port, "admin_port"),
        ]
    except UserError:
        asyncio.run(side.close())
        raise
    try:
        return asyncio.run(_serve(side, socks))
    finally:
        for s in socks:
            s.close()


async def _serve(side: Sidecar, socks: list[socket.socket]) -> int:
    s = side.settings
    servers = [
        _Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=s.access_log,
                lifespan="off",
                timeout_graceful_shutdown=3,
            )
        )
        for app in (create_api_app(side), create_admin_app(side))
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if s.exit_with_parent:
        _watch_parent(loop, stop)
    tasks: dict[str, asyncio.Task[Any]] = {
        "api": asyncio.create_task(servers[0].serve([socks[0]])),
        "admin": asyncio.create_task(servers[1].serve([socks[1]])),
        "watch": asyncio.create_task(side.watch.run()),
        "stop": asyncio.create_task(stop.wait()),
    }
    if side.job is not None:
        tasks["job"] = asyncio.create_task(side.job.run())
    log.info(
        "sidecar (%s mode, pod %d of %d): API on %s:%d, admin on %s:%d, engine %s",
        s.mode,
        s.pod_index,
        s.pods,
        s.host,
        s.port,
        s.host,
        s.admin_port,
        s.engine_url,
    )
    error: BaseException | None = None
    try:
        error = await _until_stopped(tasks, s.exit_when_done)
    finally:
        await _shutdown(side, servers, tasks)  # a second signal meanwhile changes nothing
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if error is not None:
        raise error
    return 0


def _watch_parent(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Set ``stop`` as soon as the parent process is gone, however it died."""
    ppid = os.getppid()

    def gone() -> None:
        log.info("the parent process %d is gone: stopping", ppid)
        stop.set()

    def gone_threadsafe() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the sidecar stopped already
            loop.call_soon_threadsafe(gone)

    when_gone(ppid, gone_threadsafe, name="parent-watchdog")


async def _until_stopped(tasks: dict[str, asyncio.Task[Any]], exit_when_done: bool) -> BaseException | None:
    """Wait for a signal, a failure, or (``exit_when_done``) the job's end; the failure, if any."""
    waiting = dict(tasks)
    while True:
        done, _ = await asyncio.wait(waiting.values(), return_when=asyncio.FIRST_COMPLETED)
        for name, task in list(waiting.items()):
            if task not in done:
                continue
            if name == "stop":
                log.info("stopping (signal)")
                return None
            exc = task.exception()
            if exc is not None:
                return exc
            if name == "job":
                if exit_when_done:
                    return None
                del waiting[name]  # done: keep serving progress and samples until stopped
                continue
            return RuntimeError(f"the {name} server stopped unexpectedly")


async def _shutdown(side: Sidecar, servers: list[_Server], tasks: dict[str, asyncio.Task[Any]]) -> None:
    for name in ("job", "watch", "stop"):
        if name in tasks:
            tasks[name].cancel()
    for srv in servers:
        srv.should_exit = True
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    await side.close()
    log.info("sidecar stopped")
