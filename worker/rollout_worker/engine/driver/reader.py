"""The driver's reader thread: it reads the ranks' reports and applies each under the driver's lock (a step's
tokens and finishes, a switch's end, a ticket's reply, a rank's memory, readiness or failure), then calls
the listener and the observer outside it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.engine import messages as m
from rollout_worker.engine.driver.lifecycle import Health
from rollout_worker.engine.driver.request_table import Outcome, Update
from rollout_worker.engine.driver.shared import Shared

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Observer:
    """Optional hooks for metrics (all called on the reader thread)."""

    on_report: Callable[[m.StepReport], None] | None = None
    on_tokens: Callable[[Outcome], None] | None = None
    on_finish: Callable[[Update], None] | None = None
    on_switch: Callable[[ReconfigEvent], None] | None = None


class Reader:
    def __init__(self, shared: Shared, observer: Observer) -> None:
        self.shared, self.observer = shared, observer
        self.thread = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    def _read(self) -> None:
        shared = self.shared
        while shared.life.status.health not in (Health.STOPPED, Health.FAILED):
            try:
                msgs = shared.procs.receive(timeout=0.5)
            except (EOFError, OSError):
                if shared.life.status.health is Health.STOPPING:
                    return
                msgs = [m.Failed(-1, "lost the connection to the ranks", "")]
            for msg in msgs:
                try:
                    self._handle(msg)
                except Exception:  # a bug here must not leave clients hanging
                    log.exception("engine reader failed on %s", type(msg).__name__)
                    shared.fail("internal error in the engine driver (see the server log)")
            if shared.life.status.health is Health.STOPPING and not shared.procs.procs[0].is_alive():
                return

    def _handle(self, msg: m.Report) -> None:
        shared = self.shared
        if isinstance(msg, m.StepReport):
            self._on_step(msg)
        elif isinstance(msg, m.Switched):
            self._on_switched(msg)
        elif isinstance(msg, m.Done):
            with shared.lock:
                shared.tickets.reply(msg.ticket, msg)
                shared.changed.notify_all()
        elif isinstance(msg, m.MemoryHeld):
            with shared.lock:
                shared.flags.held = tuple(
                    msg if r == msg.rank else h for r, h in enumerate(shared.flags.held)
                )
        elif isinstance(msg, m.Ready):
            with shared.lock:
                shared.flags.ready.add(msg.rank)
                if len(shared.flags.ready) == shared.cfg.world and shared.life.move(Health.READY):
                    shared.changed.notify_all()
        elif isinstance(msg, m.Failed) and shared.life.status.health is not Health.STOPPING:
            log.debug("rank %d traceback:\n%s", msg.rank, msg.traceback)
            shared.fail(shared.procs.blame(msg))

    def _on_step(self, msg: m.StepReport) -> None:
        shared, observer = self.shared, self.observer
        with shared.lock:
            out = shared.table.on_step(msg, shared.now())
            for _, rid, finish in out.aborts:
                shared.procs.broadcast(m.Abort((rid,), finish))
            if any(u.finish is not None for u in out.updates):
                shared.changed.notify_all()
                shared.fire()
        if observer.on_report:
            observer.on_report(msg)
        if observer.on_tokens:
            observer.on_tokens(out)
        if observer.on_finish:
            for u in out.updates:
                if u.finish is not None:
                    observer.on_finish(u)
        shared.listener(out.updates)

    def _on_switched(self, msg: m.Switched) -> None:
        shared = self.shared
        with shared.lock:
            event = shared.switching.on_switched(msg, shared.now() - shared.t0)
            shared.changed.notify_all()
            shared.dispatch()
            shared.fire()
        if self.observer.on_switch:
            self.observer.on_switch(event)
