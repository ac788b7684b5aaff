"""What the driver's parts share: the requests, the health, the tickets, the switch in flight, the trainers'
groups and the rank processes behind one lock, the engine's mutable flags, and the one shape of a command
that every rank answers.

One lock (``lock``) guards all of them, with one condition on it (``changed``) that wakes whoever waits for
that state to change (requests finished, a ticket answered, the health moved). A second lock
(``one_at_a_time``) lets one global command (a switch, a weight load, a memory release or resume) run at a
time: those wait for the ranks' replies without holding the first. Such a command is :meth:`Shared.send`
(under the lock: the verb's checks, a ticket, the command to every rank), then :meth:`Shared.await_` or
:meth:`Shared.gather` (the replies, waited for without the lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from rollout_worker.engine import messages as m
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.launcher import RankProcesses
from rollout_worker.engine.driver.lifecycle import Health, Lifecycle
from rollout_worker.engine.driver.request_table import Decode, RequestTable, Update
from rollout_worker.engine.driver.switching import Switching
from rollout_worker.engine.driver.tickets import Reply, Tickets
from rollout_worker.engine.driver.weight_groups import GroupBook
from rollout_worker.engine.finish import FinishAbort
from rollout_worker.engine.messages import Faults
from rollout_worker.errors import EngineError, UserError

log = logging.getLogger(__name__)
Listener = Callable[[list[Update]], None]
C = TypeVar("C", bound=m.Command)


class NothingToSend(Exception):
    """Raised by a command's checks when there is nothing to do (a switch to the layout the engine is in)."""


@dataclass(slots=True)
class Flags:
    """What the engine is doing besides its health and its requests: set under the lock; each field but
    ``ready`` an immutable value that a reader may take without it."""

    held: tuple[m.MemoryHeld | None, ...]  # per rank, the bytes it held when it last said
    paused: str | None = None  # the pause mode while paused
    hold: bool = False  # new requests wait in the driver (weight update in progress)
    released: frozenset[str] = frozenset()  # memory tags released (or being released)
    weight_version: str = "default"
    weight_loads: int = 0  # weight loads so far (the planner's sign of a new RL iteration)
    ready: set[int] = field(default_factory=set)  # ranks that loaded their weights


class Shared:
    def __init__(
        self,
        cfg: EngineConfig,
        decode: Decode | None,
        faults: Faults | None,
        listener: Listener,
        on_failure: Callable[[str], None] | None,
    ) -> None:
        self.cfg, self.listener, self.on_failure = cfg, listener, on_failure
        self.table = RequestTable(cfg.layout, decode)
        self.life = Lifecycle()
        self.tickets = Tickets()
        self.procs = RankProcesses(cfg, faults=faults)
        self.switching = Switching(self.table, self.tickets, self.procs.broadcast, cfg.candidates)
        self.groups = GroupBook()  # trainers' groups, joined or joining
        self.flags = Flags(held=(None,) * cfg.world)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.one_at_a_time = threading.Lock()  # the global commands
        self.t0 = time.monotonic()

    # -- called with the lock held ---------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    def dispatch(self) -> None:
        """Give the queued requests to the replicas, unless the engine holds them (paused, loading
        weights, switching, not serving)."""
        flags = self.flags
        if flags.paused is not None or flags.hold or self.switching.in_flight or not self.life.status.serving:
            return
        for d, spec in self.table.dispatch():
            self.procs.send(self.table.layout.ranks_of(d), m.Submit(spec))

    def fire(self) -> None:
        if self.life.status.serving:
            self.switching.fire()

    def check_serving(self) -> None:
        self.life.status.check_serving()

    # -- a command every rank answers ------------------------------------------------------------------
    def send(
        self,
        make: Callable[[int], C],
        expected: int,
        check: Callable[[], None] | None = None,
        accept: Callable[[C], None] | None = None,
    ) -> tuple[int, C]:
        """Under the lock: ``check`` (the verb's refusals or waits on ``changed``; by default, that the
        engine serves), a ticket for ``expected`` replies, ``accept(make(ticket))`` (its refusal closes
        the ticket) and that command sent to every rank. Returns the ticket, to wait on without the lock, and
        the command."""
        with self.lock:
            (check or self.check_serving)()
            ticket = self.tickets.open(expected)
            cmd = make(ticket)
            if accept is not None:
                try:
                    accept(cmd)
                except BaseException:
                    self.tickets.take(ticket)
                    raise
            self.procs.broadcast(cmd)
            return ticket, cmd

    def on_every_rank(
        self,
        make: Callable[[int], m.Command],
        idle_field: str | None,
        sent: Callable[[m.Command], None] | None = None,
    ) -> None:
        """Send every rank the command ``make(ticket)`` and wait until each has done it; with
        ``idle_field``, refused (naming that field) while requests are in flight. ``sent`` runs under the
        same lock as the check and the sending (no request is accepted in between). Called holding
        ``one_at_a_time``."""

        def check() -> None:
            self.check_serving()
            busy = self.table.unfinished
            if idle_field is not None and busy:
                raise UserError(f"{busy} request(s) in flight; abort or wait first", idle_field)

        ticket, _ = self.send(make, self.cfg.world, check, sent)
        bad_replies = [d.message for d in dones(self.await_(ticket, 120.0)) if not d.ok]
        if bad_replies:
            raise EngineError("; ".join(bad_replies))

    # -- waiting for the ranks' replies (called without the lock) -------------------------------------
    def gather(
        self, ticket: int, timeout_s: float, enough: Callable[[list[Reply]], bool] = lambda replies: False
    ) -> tuple[list[Reply], bool]:
        """The ticket's replies, and whether it is complete, once it is, once ``enough`` holds for the
        replies so far, or after ``timeout_s``; EngineError when the engine failed meanwhile."""
        with self.lock:
            self.changed.wait_for(
                lambda: (
                    self.tickets.complete(ticket)
                    or enough(self.tickets.replies(ticket))
                    or self.life.status.health is Health.FAILED
                ),
                timeout_s,
            )
            complete = self.tickets.complete(ticket)
            replies = self.tickets.take(ticket)
            status = self.life.status
        if status.health is Health.FAILED:
            raise EngineError(status.failure or "engine failed")
        return replies, complete

    def await_(self, ticket: int, timeout_s: float | None) -> list[Reply]:
        """Every reply of the ticket (by default within the ranks' longest collective timeout, and then
        some); EngineError when they did not all come."""
        limit = timeout_s if timeout_s is not None else 4 * self.cfg.engine.collective_timeout_seconds + 60
        replies, complete = self.gather(ticket, limit)
        if not complete:
            raise EngineError(f"no answer from the ranks after {limit:.0f} s")
        return replies

    # -- failure ----------------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Fail the engine (unless failed or stopped already): abort every request, stop the ranks."""
        with self.lock:
            if not self.life.move(Health.FAILED, reason):  # failed or stopped already
                return
            updates = self.table.abort_all(FinishAbort(f"engine failed: {reason}"), self.now())
            self.changed.notify_all()
        log.error("engine failed: %s", reason)
        self.listener(updates)
        self.procs.stop(grace_s=0.0)
        if self.on_failure is not None:
            self.on_failure(reason)


def dones(replies: list[Reply]) -> list[m.Done]:
    return [r for r in replies if isinstance(r, m.Done)]
