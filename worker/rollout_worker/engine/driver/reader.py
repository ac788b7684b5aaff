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
from rollout_worker.engine.driver.core import Core
from rollout_worker.engine.driver.lifecycle import Health
from rollout_worker.engine.driver.request_table import Outcome, Update

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Observer:
    """Optional hooks for metrics (all called on the reader thread)."""

    on_report: Callable[[m.StepReport], None] | None = None
    on_tokens: Callable[[Outcome], None] | None = None
    on_finish: Callable[[Update], None] | None = None
    on_switch: Callable[[ReconfigEvent], None] | None = None


class Reader:
    def __init__(self, core: Core, observer: Observer) -> None:
        self.core, self.observer = core, observer
        self.thread = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    def _read(self) -> None:
        core = self.core
        while core.life.status.health not in (Health.STOPPED, Health.FAILED):
            try:
                msgs = core.procs.receive(timeout=0.5)
            except (EOFError, OSError):
                if core.life.status.health is Health.STOPPING:
                    return
                msgs = [m.Failed(-1, "lost the connection to the ranks", "")]
            for msg in msgs:
                try:
                    self._handle(msg)
                except Exception:  # a bug here must not leave clients hanging
                    log.exception("engine reader failed on %s", type(msg).__name__)
                    core.fail("internal error in the engine driver (see the server log)")
            if core.life.status.health is Health.STOPPING and not core.procs.procs[0].is_alive():
                return

    def _handle(self, msg: m.Report) -> None:
        core = self.core
        if isinstance(msg, m.StepReport):
            self._on_step(msg)
        elif isinstance(msg, m.Switched):
            self._on_switched(msg)
        elif isinstance(msg, m.Done):
            with core.lock:
                core.tickets.reply(msg.ticket, msg)
                core.changed.notify_all()
        elif isinstance(msg, m.MemoryHeld):
            with core.lock:
                core.flags.held = tuple(msg if r == msg.rank else h for r, h in enumerate(core.flags.held))
        elif isinstance(msg, m.Ready):
            with core.lock:
                core.flags.ready.add(msg.rank)
                if len(core.flags.ready) == core.cfg.world and core.life.move(Health.READY):
                    core.changed.notify_all()
        elif isinstance(msg, m.Failed) and core.life.status.health is not Health.STOPPING:
            log.debug("rank %d traceback:\n%s", msg.rank, msg.traceback)
            core.fail(core.procs.blame(msg))

    def _on_step(self, msg: m.StepReport) -> None:
        core, observer = self.core, self.observer
        with core.lock:
            out = core.book.on_step(msg, core.now())
            for _, rid, finish in out.aborts:
                core.procs.broadcast(m.Abort((rid,), finish))
            if any(u.finish is not None for u in out.updates):
                core.changed.notify_all()
                core.fire()
        if observer.on_report:
            observer.on_report(msg)
        if observer.on_tokens:
            observer.on_tokens(out)
        if observer.on_finish:
            for u in out.updates:
                if u.finish is not None:
                    observer.on_finish(u)
        core.listener(out.updates)

    def _on_switched(self, msg: m.Switched) -> None:
        core = self.core
        with core.lock:
            event = core.switching.on_switched(msg, core.now() - core.t0)
            core.changed.notify_all()
            core.dispatch()
            core.fire()
        if self.observer.on_switch:
            self.observer.on_switch(event)
