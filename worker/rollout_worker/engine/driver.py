"""The engine as a library: a driver object in the caller's process that owns G long-lived rank processes.

Verbs (thread-safe; the slow ones block their caller, never the reader thread): ``submit`` (generate),
``abort``, ``pause`` / ``resume``, ``set_plan``, ``reconfigure``, ``state``, ``update_weights``,
``release_memory`` / ``resume_memory``, ``shutdown``. Progress reaches the caller through ``listener``,
called on the driver's reader thread once per rank report with the updates of every request it touched.
The HTTP server and ``rolloutctl generate`` are both clients of this one object.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_worker.api.costs import Method
from rollout_worker.api.errors import Conflict, EngineError, Unavailable, UserError
from rollout_worker.api.layout import Layout
from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.requests import RequestSpec, check_fits
from rollout_worker.api.state import EngineState
from rollout_worker.engine import messages as m
from rollout_worker.engine.book import Book, Decode, Outcome, Update
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.launcher import RankProcesses
from rollout_worker.engine.messages import Faults

log = logging.getLogger(__name__)
Listener = Callable[[list[Update]], None]


@dataclass(slots=True)
class _Ticket:
    expected: int
    replies: list[Any] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class Observer:
    """Optional hooks for metrics (all called on the reader thread)."""

    on_report: Callable[[m.StepReport], None] | None = None
    on_tokens: Callable[[Outcome], None] | None = None
    on_finish: Callable[[Update], None] | None = None
    on_switch: Callable[[ReconfigEvent], None] | None = None


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        *,
        decode: Decode | None = None,
        listener: Listener | None = None,
        on_failure: Callable[[str], None] | None = None,
        observer: Observer | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.cfg = cfg
        self.listener = listener or (lambda updates: None)
        self.on_failure = on_failure
        self.observer = observer or Observer()
        self.book = Book(cfg.layout, decode)
        self.health = "starting"  # starting | ready | failed | stopping | stopped
        self.failure: str | None = None
        self.paused: str | None = None
        self.hold = False  # new requests wait in the driver (weight update in progress)
        self.released: set[str] = set()
        self.weight_version = "default"
        self.weights_path = cfg.model_dir
        self._switch: int | None = None  # ticket of the global command in flight
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified whenever requests finish
        self._global = threading.Lock()  # one global command at a time
        self._tickets: dict[int, _Ticket] = {}
        self._unwaited: set[int] = set()
        self._next_ticket = itertools.count(1)
        self._ready: set[int] = set()
        self._started = threading.Event()
        self._procs = RankProcesses(cfg, faults=faults)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._t0 = time.monotonic()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout_s: float = 900.0) -> Engine:
        """Start the ranks and wait until every one has loaded its weights."""
        self._procs.start()
        self._reader.start()
        if not self._started.wait(timeout_s):
            self._fail(f"ranks not ready after {timeout_s:.0f} s")
        if self.health != "ready":
            self._reader.join(timeout=5)
            raise EngineError(self.failure or "engine failed to start")
        self._t0 = time.monotonic()
        return self

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop: optionally let in-flight requests finish, abort the rest, stop every rank."""
        with self._lock:
            if self.health in ("stopped", "stopping"):
                return
            was_failed = self.health == "failed"
            self.health = "stopping"
            if drain_timeout_s > 0 and not was_failed:
                self._idle.wait_for(lambda: self.book.unfinished == 0, drain_timeout_s)
            updates = self.book.abort_all({"type": "abort", "message": "engine shutting down"}, self._now())
            self._idle.notify_all()
        self.listener(updates)
        self._procs.stop(grace_s=0.0 if was_failed else 10.0)
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
        with self._lock:
            self.health = "stopped"

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def layout(self) -> Layout:
        return self.book.layout

    @property
    def rank_pids(self) -> list[int | None]:
        return [p.pid for p in self._procs.procs]

    def _now(self) -> float:
        return time.monotonic()

    def _check_serving(self) -> None:
        if self.health != "ready":
            raise Unavailable(f"engine is {self.health}" + (f": {self.failure}" if self.failure else ""))

    # -- verbs ---------------------------------------------------------------------------------------
    def check(self, spec: RequestSpec) -> None:
        """Refuse (UserError naming the field) a request this engine could never run."""
        cfg = self.cfg
        if not spec.prompt_ids:
            raise UserError("the prompt is empty", "input_ids")
        vocab = cfg.model.vocab_size
        bad = [t for t in spec.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"token id {bad[0]} out of range [0, {vocab})", "input_ids")
        bad = [t for t in spec.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"token id {bad[0]} out of range [0, {vocab})", "sampling_params.stop_token_ids")
        check_fits(spec, cfg.engine.context_length, cfg.engine.kv_budget_tokens)

    def submit(self, spec: RequestSpec, stop: tuple[str, ...] = ()) -> None:
        """Accept a request (validated against the model and limits); progress goes to the listener."""
        self.check(spec)
        with self._lock:
            self._check_serving()
            if self.released:
                raise Unavailable(f"memory released ({', '.join(sorted(self.released))}); resume it first")
            self.book.add(spec, stop, self._now())
            self._dispatch()

    def abort(self, rid: str | None = None, message: str = "aborted by request") -> int:
        """Abort one request (unknown ids are a no-op) or all (``rid=None``). Partial output is kept."""
        finish = {"type": "abort", "message": message}
        updates: list[Update] = []
        with self._lock:
            rids = list(self.book.reqs) if rid is None else [rid] if rid in self.book.reqs else []
            on_ranks = [r for r in rids if self.book.reqs[r].replica is not None]
            updates = [
                self.book.finalize(r, finish, self._now(), in_report=False) for r in rids if r not in on_ranks
            ]
            if on_ranks:  # to every rank: a switch may be moving the request to another replica right now
                self._procs.broadcast(m.Abort(tuple(on_ranks), finish))
            if updates:
                self._idle.notify_all()
        self.listener(updates)
        return len(rids)

    def pause(self, mode: str = "abort") -> None:
        if mode not in m.PAUSE_MODES:
            raise UserError(f"must be one of {', '.join(m.PAUSE_MODES)}, got {mode!r}", "mode")
        with self._lock:
            self._check_serving()
            self.paused = mode
            self._procs.broadcast(m.Pause(mode))
        if mode == "abort":
            with self._lock:
                updates = [
                    self.book.finalize(
                        r, {"type": "abort", "message": "aborted by pause_generation"}, self._now()
                    )
                    for r in list(self.book.queued)
                ]
            self.listener(updates)

    def resume(self) -> None:
        with self._lock:
            self._check_serving()
            self.paused = None
            self._procs.broadcast(m.Resume())
            self._dispatch()

    def set_plan(self, plan: Plan | None) -> None:
        """Replace the plan. Refused (409) unless ``plan.based_on_layout`` is the current layout."""
        with self._lock:
            self._check_serving()
            if plan is not None:
                if self._switch is not None or plan.based_on_layout != self.layout:
                    now = "switching" if self._switch is not None else f"in {self.layout}"
                    raise Conflict(
                        f"plan is based on {plan.based_on_layout}, but the engine is {now}", "based_on_layout"
                    )
                for i, trig in enumerate(plan.triggers):
                    self._check_layout(trig.layout, f"triggers[{i}].layout")
            self.book.set_plan(plan)
            self._maybe_fire()

    def reconfigure(
        self, layout: Layout, method: Method = "auto", timeout_s: float | None = None
    ) -> ReconfigEvent | None:
        """Switch to ``layout`` at the next step boundary of every replica; cancels the plan. Returns the
        event (None when already in that layout)."""
        self._check_layout(layout, "layout")
        with self._global:
            with self._lock:
                self._check_serving()
                self.book.set_plan(None)
                if layout == self.layout:
                    return None
                ticket = self._start_switch(layout, method, "requested")
            return self._await(ticket, timeout_s)[0]

    def update_weights(
        self, path: str, version: str | None = None, abort_all: bool = False, timeout_s: float = 600.0
    ) -> int:
        """Load a checkpoint of the same shape between steps, after in-flight requests finish (or are
        aborted with ``abort_all``); new requests wait meanwhile. Returns how many requests waited."""
        with self._global:
            with self._lock:
                self._check_serving()
                self.hold = True
            try:
                if abort_all:
                    self.abort(None, "aborted for a weight update")
                with self._lock:
                    if not self._idle.wait_for(lambda: self.book.dispatched == 0, timeout_s):
                        raise EngineError(
                            f"requests still in flight after {timeout_s:.0f} s; weights not updated"
                        )
                    waited = len(self.book.queued)
                    ticket = self._new_ticket(1)
                    self._procs.broadcast(m.LoadWeights(path, ticket))
                done = self._await(ticket, None)[0]
                if not done.ok:
                    raise UserError(f"weights not updated: {done.message}", "model_path")
                with self._lock:
                    self.weights_path, self.weight_version = path, version or path
                return waited
            finally:
                with self._lock:
                    self.hold = False
                    self._dispatch()

    def release_memory(self, tags: tuple[str, ...]) -> None:
        self._memory(m.ReleaseMemory, tags)

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        self._memory(m.ResumeMemory, tags)

    def _memory(self, kind: type[m.ReleaseMemory] | type[m.ResumeMemory], tags: tuple[str, ...]) -> None:
        bad = [t for t in tags if t not in m.MEMORY_TAGS]
        if bad:
            raise UserError(f"unknown tag {bad[0]!r}; choose from {', '.join(m.MEMORY_TAGS)}", "tags")
        with self._global:
            with self._lock:
                self._check_serving()
                if kind is m.ReleaseMemory and self.book.unfinished:
                    raise UserError(
                        f"{self.book.unfinished} request(s) in flight; abort or wait first", "tags"
                    )
                ticket = self._new_ticket(self.cfg.world)
                self._procs.broadcast(kind(tags, ticket))
            replies = self._await(ticket, 120.0)
            bad_replies = [r.message for r in replies if not r.ok]
            if bad_replies:
                raise EngineError("; ".join(bad_replies))
            with self._lock:
                self.released = (
                    self.released | set(tags) if kind is m.ReleaseMemory else self.released - set(tags)
                )

    def state(self, since_step: int = 0) -> EngineState:
        with self._lock:
            ready = self.health == "ready" and self._switch is None
            return self.book.snapshot(
                since_step,
                self._now() - self._t0,
                [ready and r in self._ready for r in range(self.cfg.world)],
                self.paused is not None,
                self._switch is not None,
                self.weight_version,
            )

    def reconfigurations(self) -> list[ReconfigEvent]:
        with self._lock:
            return list(self.book.events)

    def kv_usage(self) -> tuple[int, int]:
        """(KV tokens held by running requests, KV token slots allocated), over every replica."""
        with self._lock:
            used = sum(u for u, _ in self.book.kv.values())
            return used, sum(c for _, c in self.book.kv.values())

    def queued(self) -> int:
        with self._lock:
            return len(self.book.queued)

    def load(self) -> list[dict[str, int]]:
        """Per replica: running, waiting and KV tokens (``/get_load``)."""
        with self._lock:
            reps = [{"running": 0, "waiting": 0} for _ in range(self.layout.replicas)]
            for t in self.book.reqs.values():
                if t.replica is not None:
                    reps[t.replica]["running" if t.status == "running" else "waiting"] += 1
            return reps

    # -- internals (called with the lock held) ---------------------------------------------------------
    def _check_layout(self, layout: Layout, where: str) -> None:
        if layout not in self.cfg.candidates:
            raise UserError(
                f"{layout} is not among the candidate layouts ({', '.join(map(str, self.cfg.candidates))})",
                where,
            )

    def _dispatch(self) -> None:
        if self.paused is not None or self.hold or self._switch is not None or self.health != "ready":
            return
        for d, spec in self.book.dispatch():
            self._procs.send(self.layout.ranks_of(d), m.Submit(spec))

    def _new_ticket(self, expected: int) -> int:
        ticket = next(self._next_ticket)
        self._tickets[ticket] = _Ticket(expected)
        return ticket

    def _start_switch(self, layout: Layout, method: Method, reason: str) -> int:
        ticket = self._new_ticket(1)
        self._switch = ticket
        self._procs.broadcast(m.Reconfigure(layout, method, reason, ticket))
        return ticket

    def _maybe_fire(self) -> None:
        if self._switch is not None or self.health != "ready":
            return
        trig = self.book.fire()
        if trig is not None:
            n = self.book.unfinished
            ticket = self._start_switch(
                trig.layout, trig.method, f"plan: unfinished {n} <= {trig.unfinished_at_most}"
            )
            self._unwaited.add(ticket)  # nobody waits for a plan's switch

    def _await(self, ticket: int, timeout_s: float | None) -> list[Any]:
        t = self._tickets[ticket]
        limit = timeout_s if timeout_s is not None else 4 * self.cfg.engine.collective_timeout_seconds + 60
        if not t.done.wait(limit):
            raise EngineError(f"no answer from the ranks after {limit:.0f} s")
        with self._lock:
            self._tickets.pop(ticket, None)
        if self.health == "failed":
            raise EngineError(self.failure or "engine failed")
        return t.replies

    # -- the reader thread -----------------------------------------------------------------------------
    def _read(self) -> None:
        while self.health not in ("stopped", "failed"):
            try:
                msgs = self._procs.receive(timeout=0.5)
            except (EOFError, OSError):
                if self.health == "stopping":
                    return
                msgs = [m.Failed(-1, "lost the connection to the ranks", "")]
            for msg in msgs:
                try:
                    self._handle(msg)
                except Exception:  # a bug here must not leave clients hanging
                    log.exception("engine reader failed on %s", type(msg).__name__)
                    self._fail("internal error in the engine driver (see the server log)")
            if self.health == "stopping" and not self._procs.procs[0].is_alive():
                return

    def _handle(self, msg: m.Report) -> None:
        if isinstance(msg, m.StepReport):
            with self._lock:
                out = self.book.on_step(msg, self._now())
                for _, rid, finish in out.aborts:
                    self._procs.broadcast(m.Abort((rid,), finish))
                if any(u.finish for u in out.updates):
                    self._idle.notify_all()
                    self._maybe_fire()
            if self.observer.on_report:
                self.observer.on_report(msg)
            self._observe(out)
            self.listener(out.updates)
        elif isinstance(msg, m.Switched):
            with self._lock:
                event = self.book.on_switched(msg, self._now() - self._t0)
                self._switch = None
                self._reply(msg.ticket, event)
                if msg.ticket in self._unwaited:
                    self._unwaited.discard(msg.ticket)
                    self._tickets.pop(msg.ticket, None)
                self._dispatch()
                self._maybe_fire()
            if self.observer.on_switch:
                self.observer.on_switch(event)
        elif isinstance(msg, m.Done):
            with self._lock:
                self._reply(msg.ticket, msg)
        elif isinstance(msg, m.Ready):
            with self._lock:
                self._ready.add(msg.rank)
                if len(self._ready) == self.cfg.world:
                    self.health = "ready"
                    self._started.set()
        elif isinstance(msg, m.Failed) and self.health != "stopping":
            log.debug("rank %d traceback:\n%s", msg.rank, msg.traceback)
            self._fail(self._blame(msg))

    def _observe(self, out: Outcome) -> None:
        if self.observer.on_tokens:
            self.observer.on_tokens(out)
        if self.observer.on_finish:
            for u in out.updates:
                if u.finish is not None:
                    self.observer.on_finish(u)

    def _reply(self, ticket: int, reply: Any) -> None:
        t = self._tickets.get(ticket)
        if t is not None:
            t.replies.append(reply)
            if len(t.replies) >= t.expected:
                t.done.set()

    def _blame(self, msg: m.Failed) -> str:
        """A rank that died makes the survivors' collectives fail: name the dead one first."""
        time.sleep(0.2)
        dead = [r for r in self._procs.dead() if r != msg.rank]
        if dead and msg.rank >= 0:
            p = self._procs.procs[dead[0]]
            return f"rank {dead[0]} exited (code {p.exitcode}); rank {msg.rank} then failed: {msg.error}"
        return msg.error if msg.error.startswith("rank ") else f"rank {msg.rank} failed: {msg.error}"

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.health in ("failed", "stopped"):
                return
            self.health, self.failure = "failed", reason
            updates = self.book.abort_all(
                {"type": "abort", "message": f"engine failed: {reason}"}, self._now()
            )
            for t in self._tickets.values():
                t.done.set()
            self._idle.notify_all()
            self._started.set()
        log.error("engine failed: %s", reason)
        self.listener(updates)
        self._procs.stop(grace_s=0.0)
        if self.on_failure is not None:
            self.on_failure(reason)
