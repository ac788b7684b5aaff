"""The parent side: start G rank processes, relay their events, watch them, and never leave orphans.

CPU runs use a forkserver (torch is imported once; each rank forks in ~0.1 s); CUDA runs use spawn.
Any rank error, a rank that dies, the overall deadline or Ctrl-C tears every rank down.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue as queue_mod
import socket
import time
from collections.abc import Callable
from typing import Any

from rollout_worker.api.errors import EngineError
from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.rank import RankEngine, rank_main

log = logging.getLogger(__name__)
OnEvent = Callable[[str, int, dict[str, Any]], None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context(device: str) -> Any:
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rollout_worker.engine.rank", "rollout_worker.engine.reconfig"])
    return ctx


def run_ranks(
    cfg: EngineConfig,
    specs: list[RequestSpec],
    on_event: OnEvent | None = None,
    task: Callable[[RankEngine, dict[str, Any]], dict[str, Any]] | None = None,
    task_args: dict[str, Any] | None = None,
    deadline_s: float = 3600.0,
) -> list[dict[str, Any]]:
    """Run ``task`` (default: generation of ``specs``) on ``cfg.world`` ranks; one result per rank."""
    ctx = _context(cfg.device)
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(
            target=rank_main, args=(r, cfg, specs, init, q, task, task_args), name=f"rank{r}", daemon=True
        )
        for r in range(cfg.world)
    ]
    results: dict[int, dict[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        _collect(procs, q, results, on_event, time.monotonic() + deadline_s)
    finally:
        _teardown(procs, graceful=len(results) == len(procs))
    return [results[r] for r in range(cfg.world)]


def _collect(
    procs: list[Any], q: Any, results: dict[int, dict[str, Any]], on_event: OnEvent | None, deadline: float
) -> None:
    while len(results) < len(procs):
        try:
            kind, rank, payload = q.get(timeout=0.2)
        except queue_mod.Empty:
            _check_alive(procs, results)
            if time.monotonic() > deadline:
                raise EngineError("engine deadline exceeded; all ranks were stopped") from None
            continue
        if kind == "done":
            results[rank] = payload
        elif kind == "error":
            log.debug("rank %d traceback:\n%s", rank, payload["traceback"])
            raise EngineError(f"rank {rank} failed: {payload['error']}")
        elif on_event is not None:
            on_event(kind, rank, payload)


def _check_alive(procs: list[Any], results: dict[int, dict[str, Any]]) -> None:
    for r, p in enumerate(procs):
        if r not in results and p.exitcode is not None:
            raise EngineError(f"rank {r} exited with code {p.exitcode} before finishing")


def _teardown(procs: list[Any], graceful: bool) -> None:
    """After success ranks exit on their own; after a failure the survivors may sit in a collective."""
    procs = [p for p in procs if p.pid is not None]  # started ones only
    if graceful:
        for p in procs:
            p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join(timeout=2)
