"""The driver's side of the rank processes: start them, send them commands, receive their reports, notice
when one dies, and stop them all without leaving a process behind.

CPU runs use a forkserver (torch is imported once; each rank forks in ~0.1 s); CUDA runs use spawn. Ranks
end themselves when the driver dies, however it dies (see :mod:`rollout_worker.engine.loop`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from rollout_worker.api.errors import EngineError
from rollout_worker.engine import messages as m
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.messages import Faults
from rollout_worker.proc import rendezvous_port

log = logging.getLogger(__name__)
Task = Callable[[Any, dict[str, Any]], dict[str, Any]]  # (RankState, args) -> result, run in every rank


def rank_entry(*args: Any) -> None:
    """Process target: imports torch in the rank (preloaded by the forkserver), never in the driver."""
    from rollout_worker.engine.loop import rank_main

    rank_main(*args)


class RankDied(EngineError):
    def __init__(self, rank: int, exitcode: int | None) -> None:
        how = (
            f"was killed by signal {-exitcode}"
            if exitcode is not None and exitcode < 0
            else f"exited with code {exitcode}"
        )
        super().__init__(f"rank {rank} {how}")
        self.rank, self.exitcode = rank, exitcode


def _context(device: str) -> Any:
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rollout_worker.engine.loop"])
    return ctx


class RankProcesses:
    """G rank processes with one inbox each and one shared, causally ordered report pipe."""

    def __init__(
        self,
        cfg: EngineConfig,
        faults: Faults | None = None,
        task: Task | None = None,
        task_args: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        ctx = _context(cfg.engine.device)
        self._reader, writer = ctx.Pipe(duplex=False)
        lock = ctx.Lock()
        self.inboxes = [ctx.Queue() for _ in range(cfg.world)]
        init = f"tcp://127.0.0.1:{rendezvous_port()}"
        self.procs = [
            ctx.Process(
                target=rank_entry,
                args=(r, cfg, init, self.inboxes[r], writer, lock, os.getpid(), faults, task, task_args),
                name=f"rank{r}",
                daemon=True,
            )
            for r in range(cfg.world)
        ]
        self._writer = writer
        self._lock = lock  # Process.start() drops its args: keep the lock alive until the children have it
        self.stopping = False

    def start(self) -> None:
        for p in self.procs:
            p.start()
        self._writer.close()  # only the ranks write; EOF then means every rank is gone

    def send(self, ranks: Sequence[int], msg: m.Command) -> None:
        for r in ranks:
            self.inboxes[r].put(msg)

    def broadcast(self, msg: m.Command) -> None:
        self.send(range(self.cfg.world), msg)

    def receive(self, timeout: float | None) -> list[m.Report]:
        """Reports waiting now (blocks up to ``timeout`` for the first). Raises RankDied if a rank exited
        while not stopping (after reading what it sent before dying)."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        ready = wait([self._reader, *sentinels], timeout)
        out: list[m.Report] = []
        while self._reader.poll(0):
            try:
                out.append(self._reader.recv())
            except EOFError:
                break
        if not self.stopping:
            for s in ready:
                if s in sentinels:
                    r = sentinels[s]
                    out.append(m.Failed(r, str(RankDied(r, self.procs[r].exitcode)), ""))
        return out

    def dead(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.exitcode is not None]

    def dead_besides(self, rank: int, within_s: float) -> list[int]:
        """Ranks other than ``rank`` that have exited, waiting up to ``within_s`` for one to exit. A rank's
        death fails its peers' collectives at once, but its exit is known (its sentinel ready, its exit code
        set) only once reaped, so a peer's report of the failure can arrive first."""
        others = {p.sentinel: p for r, p in enumerate(self.procs) if r != rank and p.pid is not None}
        for sentinel in wait(list(others), within_s) if others else []:
            others[sentinel].join(within_s)  # it has exited: this returns once it is reaped
        return [r for r in self.dead() if r != rank]

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask politely (Shutdown), then terminate, then kill: nothing outlives this call."""
        self.stopping = True
        started = [p for p in self.procs if p.pid is not None]
        if any(p.is_alive() for p in started) and grace_s > 0:
            for q in self.inboxes:
                q.put(m.Shutdown())
            deadline = time.monotonic() + grace_s
            for p in started:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for q in self.inboxes:
            q.cancel_join_thread()
            q.close()
        self._reader.close()


def run_task(
    cfg: EngineConfig, task: Task, args: dict[str, Any], deadline_s: float = 3600.0
) -> list[dict[str, Any]]:
    """Run a measurement ``task(state, args)`` on every rank (same code path as serving); one result each."""
    procs = RankProcesses(cfg, task=task, task_args=args)
    results: dict[int, dict[str, Any]] = {}
    try:
        procs.start()
        deadline = time.monotonic() + deadline_s
        while len(results) < cfg.world:
            if time.monotonic() > deadline:
                raise EngineError("measurement deadline exceeded; all ranks were stopped")
            for msg in procs.receive(timeout=0.5):
                if isinstance(msg, m.TaskResult):
                    results[msg.rank] = msg.result
                elif isinstance(msg, m.Failed) and msg.rank not in results:
                    log.debug("rank %d traceback:\n%s", msg.rank, msg.traceback)
                    raise EngineError(f"rank {_culprit(procs, msg.rank)} failed: {msg.error}")
    finally:
        procs.stop(grace_s=10.0 if len(results) == cfg.world else 0.0)
    return [results[r] for r in range(cfg.world)]


def _culprit(procs: RankProcesses, reporter: int) -> int:
    """A rank that died makes the survivors' collectives fail: blame the dead one, not the reporter."""
    time.sleep(0.2)
    dead = procs.dead()
    return dead[0] if dead and reporter not in dead else reporter
