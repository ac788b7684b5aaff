"""The driver's side of the rank processes: start them, send them commands, receive their reports, notice
when one dies (the moment it exits: its pidfd) and name the rank that died first, and stop them all without
leaving a process behind.

CPU runs use a forkserver (torch is imported once; each rank forks in ~0.1 s); CUDA runs use spawn. Ranks
end themselves when the driver dies, however it dies (see :mod:`rollout_worker.engine.rank.step_loop`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from rollout_worker.engine import messages as m
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.messages import Faults
from rollout_worker.errors import EngineError
from rollout_worker.proc import rendezvous_port

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
REAP_S = 5.0  # a dead rank's exit status is known once its parent reaps it (at once; bounded anyway)
Task = Callable[[Any, dict[str, Any]], dict[str, Any]]  # (RankState, args) -> result, run in every rank


def rank_entry(*args: Any) -> None:
    """Process target: imports torch in the rank (preloaded by the forkserver), never in the driver."""
    from rollout_worker.engine.rank.step_loop import rank_main

    rank_main(*args)


class RankDied(EngineError):
    def __init__(self, rank: int, exitcode: int | None) -> None:
        if exitcode is None:
            how = "died"
        elif exitcode < 0:
            how = f"was killed by signal {-exitcode}"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(f"rank {rank} {how}")
        self.rank, self.exitcode = rank, exitcode


def _context(device: str) -> Any:
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rollout_worker.engine.rank.step_loop"])
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
        store = (LOOPBACK, rendezvous_port(LOOPBACK))  # the ranks share this machine's (or pod's) loopback
        self.procs = [
            ctx.Process(
                target=rank_entry,
                args=(r, cfg, store, self.inboxes[r], writer, lock, os.getpid(), faults, task, task_args),
                name=f"rank{r}",
                daemon=True,
            )
            for r in range(cfg.world)
        ]
        self._writer = writer
        self._lock = lock  # Process.start() drops its args: keep the lock alive until the children have it
        self._guard = threading.Lock()  # start and stop, one at a time: a stop while starting stops all
        self._exits: dict[int, int] = {}  # rank -> pidfd, readable once it has exited (ranks not seen dead)
        # the reader thread notices exits (and closes their pidfds) while stop() may close the rest
        self._exits_lock = threading.Lock()
        self.deaths: list[int] = []  # ranks seen dead, in the order seen
        self.reported: set[int] = set()  # ranks whose own failure report was read
        self.stopping = False

    def start(self) -> None:
        with self._guard:
            if self.stopping:
                raise EngineError("the engine was stopped before its ranks started")
            for r, p in enumerate(self.procs):
                p.start()
                try:
                    pidfd = os.pidfd_open(p.pid or 0)
                    with self._exits_lock:
                        self._exits[r] = pidfd
                except ProcessLookupError:  # dead and reaped already
                    self.deaths.append(r)
            self._writer.close()  # only the ranks write; EOF then means every rank is gone

    def send(self, ranks: Sequence[int], msg: m.Command) -> None:
        for r in ranks:
            self.inboxes[r].put(msg)

    def broadcast(self, msg: m.Command) -> None:
        self.send(range(self.cfg.world), msg)

    def receive(self, timeout: float | None) -> list[m.Report]:
        """Reports waiting now (blocks up to ``timeout`` for the first, or for a rank's exit), then, unless
        stopping, a Failed for each rank that exited without a failure report of its own."""
        with self._exits_lock:
            pidfds = list(self._exits.values())
        wait([self._reader, *pidfds], timeout)
        exited = self._notice_exits()
        out: list[m.Report] = []
        while self._reader.poll(0):  # after the exits: what a rank wrote before it exited is read now
            try:
                msg = self._reader.recv()
            except EOFError:
                break
            if isinstance(msg, m.Failed):
                self.reported.add(msg.rank)
            out.append(msg)
        if not self.stopping:
            out += [m.Failed(r, self.death(r), "") for r in exited if r not in self.reported]
        return out

    def _notice_exits(self) -> list[int]:
        """Ranks that exited since the last call (a pidfd turns readable the moment its process exits,
        before its parent reaps it), appended to ``deaths``."""
        with self._exits_lock:
            ready = set(wait(list(self._exits.values()), 0)) if self._exits else set()
            exited = [r for r, fd in self._exits.items() if fd in ready]
            for r in exited:
                os.close(self._exits.pop(r))
        self.deaths += exited
        return exited

    def death(self, rank: int) -> str:
        """How ``rank`` (seen dead) died: its exit status, known once its parent reaped it (at once)."""
        p = self.procs[rank]
        p.join(REAP_S)
        return str(RankDied(rank, p.exitcode))

    def blame(self, failed: m.Failed) -> str:
        """A failure as its cause: a rank's death fails its peers' collectives, so the rank that died
        first without a report (killed, crashed) is named before the reporter. Without one the reporter is
        the culprit: the report pipe is causally ordered, the first report is the first failure. Never
        waits for a death: a rank dead before its peer's report was read has been seen (``receive``)."""
        why = (
            failed.error if failed.error.startswith("rank ") else f"rank {failed.rank} failed: {failed.error}"
        )
        first = next((r for r in self.deaths if r not in self.reported), None)
        if failed.rank < 0 or first is None or first == failed.rank:
            return why
        return f"{self.death(first)}; rank {failed.rank} then failed: {failed.error}"

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask politely (Shutdown), then terminate, then kill: nothing outlives this call (nor starts after
        it: a ``start`` under way finishes first, a later one is refused)."""
        with self._guard:
            self.stopping = True
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
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
        with self._exits_lock:
            for fd in self._exits.values():
                os.close(fd)
            self._exits.clear()


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
                    raise EngineError(procs.blame(msg))
    finally:
        procs.stop(grace_s=10.0 if len(results) == cfg.world else 0.0)
    return [results[r] for r in range(cfg.world)]
