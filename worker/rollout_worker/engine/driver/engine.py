"""The engine as a library: a driver object in the caller's process that owns G long-lived rank processes.

Verbs (thread-safe; the slow ones block their caller, never the reader thread): ``submit`` (generate),
``abort``, ``pause`` / ``resume``, ``set_plan``, ``reconfigure``, ``state``, ``update_weights``,
``join_weight_group`` / ``leave_weight_group``, ``release_memory`` / ``resume_memory``, ``shutdown``;
``snapshot``, ``status`` and what the engine is doing (``paused``, ``released``, ``joining``) for readers.
Progress reaches the caller through ``listener``, called on the driver's reader thread once per rank report
with the updates of every request it touched. The HTTP server and ``rolloutctl generate`` are both clients
of this one object.

The driver composes: the requests (:mod:`~rollout_worker.engine.driver.request_table`), the health
(:mod:`~rollout_worker.engine.driver.lifecycle`), the replies the ranks owe
(:mod:`~rollout_worker.engine.driver.tickets`),
the plan and the switch in flight (:mod:`~rollout_worker.engine.driver.switching`) and the rank processes
(:mod:`~rollout_worker.engine.driver.launcher`). One lock guards all of them, with one condition on it that
wakes
whoever waits for that state to change (requests finished, a ticket answered, the health moved). A second
lock lets one global command (a switch, a weight load, a memory release or resume) run at a time: those
wait for the ranks' replies without holding the first. A join of a trainer's group takes neither while it
waits: the ranks join beside their step loops, and generation goes on. The reader thread takes the first
lock only to apply a report, and calls the listener and the observer outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.requests import RequestSpec, check_fits
from rollout_worker.api.sglang import MEMORY_TAGS
from rollout_worker.api.state import EngineState
from rollout_worker.engine import messages as m
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver import snapshot
from rollout_worker.engine.driver.launcher import RankProcesses
from rollout_worker.engine.driver.lifecycle import Health, Lifecycle, Status
from rollout_worker.engine.driver.request_table import Book, Decode, Outcome, Update
from rollout_worker.engine.driver.switching import Switching
from rollout_worker.engine.driver.tickets import Reply, Tickets
from rollout_worker.engine.driver.weight_groups import GroupBook, Joining
from rollout_worker.engine.finish import PAUSE_ABORT, FinishAbort
from rollout_worker.engine.messages import Faults
from rollout_worker.errors import EngineError, Unavailable, UserError
from rollout_worker.scheduling.costs import Method
from rollout_worker.scheduling.layout import Layout

log = logging.getLogger(__name__)
Listener = Callable[[list[Update]], None]


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
        self._book = Book(cfg.layout, decode)
        self._life = Lifecycle()
        self._tickets = Tickets()
        self._procs = RankProcesses(cfg, faults=faults)
        self._switching = Switching(self._book, self._tickets, self._procs.broadcast, cfg.candidates)
        self._paused: str | None = None  # the pause mode while paused
        self._hold = False  # new requests wait in the driver (weight update in progress)
        self._released: frozenset[str] = frozenset()  # memory tags released (or being released)
        self._held: tuple[m.MemoryHeld | None, ...] = (None,) * cfg.world  # per rank, as it last said
        self._groups = GroupBook()  # trainers' groups, joined or joining
        self._weight_version = "default"
        self._weight_loads = 0  # weight loads so far (the planner's sign of a new RL iteration)
        self._ready: set[int] = set()  # ranks that loaded their weights
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._global = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._t0 = time.monotonic()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout_s: float = 900.0) -> Engine:
        """Start the ranks and wait until every one has loaded its weights."""
        self._procs.start()
        self._reader.start()
        with self._lock:
            started = self._changed.wait_for(
                lambda: self._life.status.health is not Health.STARTING, timeout_s
            )
        if not started:
            self._fail(f"ranks not ready after {timeout_s:.0f} s")
        status = self._life.status
        if not status.serving:
            self._reader.join(timeout=5)
            raise EngineError(status.failure or "engine failed to start")
        self._t0 = time.monotonic()
        return self

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop: optionally let in-flight requests finish, abort the rest, stop every rank."""
        with self._lock:
            was_failed = self._life.status.health is Health.FAILED
            if not self._life.move(Health.STOPPING):  # stopping or stopped already
                return
            self._changed.notify_all()
            if drain_timeout_s > 0 and not was_failed:
                self._changed.wait_for(lambda: self._book.unfinished == 0, drain_timeout_s)
            updates = self._book.abort_all(FinishAbort("engine shutting down"), self._now())
            self._changed.notify_all()
        self.listener(updates)
        self._procs.stop(grace_s=0.0 if was_failed else 10.0)
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
        with self._lock:
            self._life.move(Health.STOPPED)
            self._changed.notify_all()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- what readers see (no lock needed: immutable values) -------------------------------------------
    @property
    def status(self) -> Status:
        return self._life.status

    @property
    def layout(self) -> Layout:
        return self._book.layout

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def paused(self) -> str | None:
        """The pause mode while paused."""
        return self._paused

    @property
    def released(self) -> tuple[str, ...]:
        """The memory tags released (from the moment a release is sent until a resume of them returns)."""
        return tuple(sorted(self._released))

    @property
    def joining(self) -> tuple[Joining, ...]:
        """Joins of trainers' groups under way."""
        return self._groups.joining

    @property
    def memory_held(self) -> tuple[m.MemoryHeld | None, ...]:
        """Per rank, the bytes it held when it last said (once started, and after each release / resume)."""
        return self._held

    @property
    def rank_pids(self) -> list[int | None]:
        return [p.pid for p in self._procs.procs]

    def snapshot(self) -> snapshot.Snapshot:
        """Health, layout, requests per replica and KV use, taken together."""
        with self._lock:
            return snapshot.take(self._book, self._life.status, self._paused, self._weight_version)

    def state(self, since_step: int = 0) -> EngineState:
        with self._lock:
            ready = self._life.status.serving and not self._switching.in_flight
            return self._book.snapshot(
                since_step,
                self._now() - self._t0,
                [ready and r in self._ready for r in range(self.cfg.world)],
                self._paused is not None,
                self._switching.in_flight,
                self._weight_version,
                self._weight_loads,
            )

    def reconfigurations(self) -> list[ReconfigEvent]:
        with self._lock:
            return list(self._book.events)

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
        if spec.return_logprob and spec.logprob_start_len >= len(spec.prompt_ids):  # as SGLang refuses it
            raise UserError(
                f"{spec.logprob_start_len} is not below the prompt's length ({len(spec.prompt_ids)} tokens)",
                "logprob_start_len",
            )
        check_fits(spec, cfg.engine.context_length, cfg.engine.kv_budget_tokens)

    def submit(self, spec: RequestSpec, stop: tuple[str, ...] = ()) -> None:
        """Accept a request (validated against the model and limits); progress goes to the listener."""
        self.submit_all([(spec, stop)])

    def submit_all(self, jobs: Sequence[tuple[RequestSpec, tuple[str, ...]]], checked: bool = False) -> None:
        """Accept every request (with its stop strings) or, when one is refused, none; ``checked``: the
        caller ran :meth:`check` on each already."""
        for spec, _ in () if checked else jobs:
            self.check(spec)
        with self._lock:
            self._life.status.check_serving()
            if self._released:
                raise Unavailable(f"memory released ({', '.join(sorted(self._released))}); resume it first")
            self._book.add_all(jobs, self._now())
            self._dispatch()

    def abort(self, rid: str | Collection[str] | None = None, message: str = "aborted by request") -> int:
        """Abort one request, several (unknown ids are a no-op) or all (``rid=None``). Partial output is
        kept."""
        finish = FinishAbort(message)
        with self._lock:
            book = self._book
            asked = book.reqs if rid is None else [rid] if isinstance(rid, str) else dict.fromkeys(rid)
            rids = [r for r in asked if r in book.reqs]
            on_ranks = [r for r in rids if book.reqs[r].replica is not None]
            updates = [
                book.finalize(r, finish, self._now(), in_report=False)
                for r in rids
                if book.reqs[r].replica is None
            ]
            if on_ranks:  # to every rank: a switch may be moving the request to another replica right now
                self._procs.broadcast(m.Abort(tuple(on_ranks), finish))
            if updates:
                self._changed.notify_all()
        self.listener(updates)
        return len(rids)

    def pause(self, mode: str = "abort") -> None:
        if mode not in m.PAUSE_MODES:
            raise UserError(f"must be one of {', '.join(m.PAUSE_MODES)}, got {mode!r}", "mode")
        updates: list[Update] = []
        with self._lock:
            self._life.status.check_serving()
            self._paused = mode
            self._procs.broadcast(m.Pause(mode))
            if mode == "abort":  # the ranks abort theirs; the driver, those not on a replica yet
                updates = [self._book.finalize(r, PAUSE_ABORT, self._now()) for r in list(self._book.queued)]
            self._changed.notify_all()  # a weight update waiting for requests in flight goes ahead now
        self.listener(updates)

    def resume(self) -> None:
        with self._lock:
            self._life.status.check_serving()
            self._paused = None
            self._procs.broadcast(m.Resume())
            self._dispatch()

    def set_plan(self, plan: Plan | None) -> None:
        """Replace the plan. Refused (409) unless ``plan.based_on_layout`` is the current layout."""
        with self._lock:
            self._life.status.check_serving()
            self._switching.set_plan(plan)
            self._fire()

    def reconfigure(
        self, layout: Layout, method: Method = "auto", timeout_s: float | None = None
    ) -> ReconfigEvent | None:
        """Switch to ``layout`` at the next step boundary of every replica; cancels the plan. Returns the
        event (None when already in that layout)."""
        self._switching.check_layout(layout, "layout")
        with self._global:
            with self._lock:
                self._life.status.check_serving()
                self._switching.set_plan(None)
                if layout == self._book.layout:
                    return None
                ticket = self._switching.start(layout, method, "requested")
            return next(r for r in self._await(ticket, timeout_s) if isinstance(r, ReconfigEvent))

    def update_weights(
        self, path: str, version: str | None = None, abort_all: bool = False, timeout_s: float = 600.0
    ) -> int:
        """Load a checkpoint of the same shape between steps, after in-flight requests finish (or are
        aborted with ``abort_all``); new requests wait meanwhile. While paused (as SGLang, the order slime
        and VeRL use: pause, update, continue) it loads at once: the paused requests keep their place and go
        on with the new weights after ``resume`` (``in_place``: over the K/V the old weights computed;
        ``retract``: recomputed). The weights are then called ``version``, or keep the current version's
        name when none is given (as SGLang's updates do). Returns how many requests waited (queued or
        paused)."""
        make = lambda t: m.LoadWeights(path, t)  # noqa: E731
        return self._between_steps(make, version, abort_all, timeout_s, "model_path")

    def update_weights_from_group(
        self,
        group_name: str,
        cmd: Callable[[int], m.ReceiveWeights],
        version: str | None,
        abort_all: bool = False,
        timeout_s: float = 600.0,
    ) -> int:
        """As ``update_weights``, the checkpoint received from a trainer's broadcast (``weight_sync``) in
        the group ``group_name``, which every rank must have joined."""
        return self._between_steps(cmd, version, abort_all, timeout_s, "names", group_name)

    def check_weight_group(self, name: str) -> None:
        """Refuse a trainer's group every rank has not joined: unknown (400) or still joining (409)."""
        with self._lock:
            self._groups.check_joined(name)

    def join_weight_group(self, join: Callable[[int], m.JoinWeightGroup]) -> None:
        """Every rank joins a trainer's group beside its step loop (generation goes on meanwhile). Returns
        once every rank has joined; after the first rank that could not, or after the join's timeout, every
        rank leaves the group again and a UserError naming ``master_address`` says why."""
        with self._lock:
            self._life.status.check_serving()
            ticket = self._tickets.open(self.cfg.world)
            cmd = join(ticket)
            try:
                self._groups.begin(cmd, self._now())
            except UserError:
                self._tickets.take(ticket)
                raise
            self._procs.broadcast(cmd)
        name, where = cmd.group_name, f"{cmd.master_address}:{cmd.master_port}"
        try:
            replies, _ = self._gather(ticket, cmd.timeout_s, lambda rs: any(not d.ok for d in _dones(rs)))
        except BaseException:
            self._give_up(name)
            raise
        dones = _dones(replies)
        failed = [d.message for d in dones if not d.ok]
        if not failed and len(dones) == self.cfg.world:
            with self._lock:
                self._groups.end(name, joined=True)
            return
        self._give_up(name)
        if failed:
            why = f"could not join the trainer's rendezvous at {where}: {failed[0]}"
        else:
            missing = sorted(set(range(self.cfg.world)) - {d.rank for d in dones})
            why = (
                f"no trainer's rendezvous answered at {where} within {cmd.timeout_s:g} s "
                f"(rank(s) {', '.join(map(str, missing))} still waiting)"
            )
        raise UserError(f"weight update group {name!r} not joined: {why}", "master_address")

    def _give_up(self, name: str) -> None:
        """Every rank leaves ``name`` (a join under way is dropped when it ends); nobody waits for it."""
        with self._lock:
            self._groups.end(name, joined=False)
            if self._life.status.serving:
                self._procs.broadcast(m.LeaveWeightGroup(name, self._tickets.open(self.cfg.world, False)))

    def leave_weight_group(self, name: str) -> None:
        """Every rank leaves a trainer's group it joined, at its next step boundary."""
        with self._global:
            self.check_weight_group(name)
            self._on_every_rank(lambda ticket: m.LeaveWeightGroup(name, ticket), None)
            with self._lock:
                self._groups.forget(name)

    def _between_steps(
        self,
        make: Callable[[int], m.LoadWeights | m.ReceiveWeights],
        version: str | None,
        abort_all: bool,
        timeout_s: float,
        field: str,
        group: str | None = None,
    ) -> int:
        """Run a weight load (``make``) between steps; ``group``: the trainer's group it receives from,
        checked joined under the global lock (no leave between the check and the receive)."""
        with self._global:
            with self._lock:
                self._life.status.check_serving()
                if group is not None:
                    self._groups.check_joined(group)
                self._hold = True
            try:
                if abort_all:
                    self.abort(None, "aborted for a weight update")
                with self._lock:  # paused requests keep their place (see update_weights)
                    idle = lambda: self._book.dispatched == 0 or self._paused is not None  # noqa: E731
                    if not self._changed.wait_for(idle, timeout_s):
                        raise EngineError(
                            f"requests still in flight after {timeout_s:.0f} s; weights not updated"
                        )
                    waited = self._book.unfinished
                    ticket = self._tickets.open(1)
                    self._procs.broadcast(make(ticket))
                (done,) = _dones(self._await(ticket, None))
                if not done.ok:
                    raise UserError(f"weights not updated: {done.message}", field)
                with self._lock:
                    self._weight_version = self._weight_version if version is None else version
                    self._weight_loads += 1
                return waited
            finally:
                with self._lock:
                    self._hold = False
                    self._dispatch()

    def set_weight_version(self, version: str, abort_all: bool = False) -> None:
        """Name the weights being served (what ``meta_info.weight_version`` reports), aborting every
        request first with ``abort_all``."""
        if abort_all:
            self.abort(None, "aborted for a weight version update")
        with self._lock:
            self._life.status.check_serving()
            self._weight_version = version

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Every rank frees the memory of ``tags``; returns once every rank has (refused while requests are
        in flight). New requests are refused (503) from the moment the ranks are told until a resume of
        these tags returns."""
        self._memory(m.ReleaseMemory, tags)

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Every rank takes the memory of ``tags`` again; returns once every rank holds it."""
        self._memory(m.ResumeMemory, tags)

    def flush_cache(self) -> None:
        """Empty every replica's prefix cache (refused while requests are in flight)."""
        with self._global:
            self._on_every_rank(m.FlushCache, None)

    def _memory(self, kind: type[m.ReleaseMemory] | type[m.ResumeMemory], tags: tuple[str, ...]) -> None:
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise UserError(f"unknown tag {bad[0]!r}; choose from {', '.join(MEMORY_TAGS)}", "tags")
        release = kind is m.ReleaseMemory

        def sent() -> None:  # new requests are refused from the moment a release goes out
            if release:
                self._released |= set(tags)

        with self._global:
            self._on_every_rank(lambda ticket: kind(tags, ticket), "tags" if release else None, sent)
            if not release:
                with self._lock:
                    self._released -= set(tags)

    def _on_every_rank(
        self,
        make: Callable[[int], m.Command],
        idle_field: str | None,
        sent: Callable[[], None] = lambda: None,
    ) -> None:
        """Send every rank the command ``make(ticket)`` and wait until each has done it; with
        ``idle_field``, refused (naming that field) while requests are in flight. ``sent`` runs under the
        same lock as the check and the sending (no request is accepted in between). Called holding
        ``_global``."""
        with self._lock:
            self._life.status.check_serving()
            if idle_field is not None and self._book.unfinished:
                raise UserError(
                    f"{self._book.unfinished} request(s) in flight; abort or wait first", idle_field
                )
            ticket = self._tickets.open(self.cfg.world)
            self._procs.broadcast(make(ticket))
            sent()
        bad_replies = [d.message for d in _dones(self._await(ticket, 120.0)) if not d.ok]
        if bad_replies:
            raise EngineError("; ".join(bad_replies))

    # -- internals (called with the lock held) ---------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic()

    def _dispatch(self) -> None:
        if (
            self._paused is not None
            or self._hold
            or self._switching.in_flight
            or not self._life.status.serving
        ):
            return
        for d, spec in self._book.dispatch():
            self._procs.send(self._book.layout.ranks_of(d), m.Submit(spec))

    def _fire(self) -> None:
        if self._life.status.serving:
            self._switching.fire()

    # -- waiting for the ranks' replies (called without the lock) -------------------------------------
    def _gather(
        self, ticket: int, timeout_s: float, enough: Callable[[list[Reply]], bool] = lambda replies: False
    ) -> tuple[list[Reply], bool]:
        """The ticket's replies, and whether it is complete, once it is, once ``enough`` holds for the
        replies so far, or after ``timeout_s``; EngineError when the engine failed meanwhile."""
        with self._lock:
            self._changed.wait_for(
                lambda: (
                    self._tickets.complete(ticket)
                    or enough(self._tickets.replies(ticket))
                    or self._life.status.health is Health.FAILED
                ),
                timeout_s,
            )
            complete = self._tickets.complete(ticket)
            replies = self._tickets.take(ticket)
            status = self._life.status
        if status.health is Health.FAILED:
            raise EngineError(status.failure or "engine failed")
        return replies, complete

    def _await(self, ticket: int, timeout_s: float | None) -> list[Reply]:
        limit = timeout_s if timeout_s is not None else 4 * self.cfg.engine.collective_timeout_seconds + 60
        replies, complete = self._gather(ticket, limit)
        if not complete:
            raise EngineError(f"no answer from the ranks after {limit:.0f} s")
        return replies

    # -- the reader thread -----------------------------------------------------------------------------
    def _read(self) -> None:
        while self._life.status.health not in (Health.STOPPED, Health.FAILED):
            try:
                msgs = self._procs.receive(timeout=0.5)
            except (EOFError, OSError):
                if self._life.status.health is Health.STOPPING:
                    return
                msgs = [m.Failed(-1, "lost the connection to the ranks", "")]
            for msg in msgs:
                try:
                    self._handle(msg)
                except Exception:  # a bug here must not leave clients hanging
                    log.exception("engine reader failed on %s", type(msg).__name__)
                    self._fail("internal error in the engine driver (see the server log)")
            if self._life.status.health is Health.STOPPING and not self._procs.procs[0].is_alive():
                return

    def _handle(self, msg: m.Report) -> None:
        if isinstance(msg, m.StepReport):
            self._on_step(msg)
        elif isinstance(msg, m.Switched):
            self._on_switched(msg)
        elif isinstance(msg, m.Done):
            with self._lock:
                self._tickets.reply(msg.ticket, msg)
                self._changed.notify_all()
        elif isinstance(msg, m.MemoryHeld):
            with self._lock:
                self._held = tuple(msg if r == msg.rank else h for r, h in enumerate(self._held))
        elif isinstance(msg, m.Ready):
            with self._lock:
                self._ready.add(msg.rank)
                if len(self._ready) == self.cfg.world and self._life.move(Health.READY):
                    self._changed.notify_all()
        elif isinstance(msg, m.Failed) and self._life.status.health is not Health.STOPPING:
            log.debug("rank %d traceback:\n%s", msg.rank, msg.traceback)
            self._fail(self._procs.blame(msg))

    def _on_step(self, msg: m.StepReport) -> None:
        with self._lock:
            out = self._book.on_step(msg, self._now())
            for _, rid, finish in out.aborts:
                self._procs.broadcast(m.Abort((rid,), finish))
            if any(u.finish is not None for u in out.updates):
                self._changed.notify_all()
                self._fire()
        if self.observer.on_report:
            self.observer.on_report(msg)
        if self.observer.on_tokens:
            self.observer.on_tokens(out)
        if self.observer.on_finish:
            for u in out.updates:
                if u.finish is not None:
                    self.observer.on_finish(u)
        self.listener(out.updates)

    def _on_switched(self, msg: m.Switched) -> None:
        with self._lock:
            event = self._switching.on_switched(msg, self._now() - self._t0)
            self._changed.notify_all()
            self._dispatch()
            self._fire()
        if self.observer.on_switch:
            self.observer.on_switch(event)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if not self._life.move(Health.FAILED, reason):  # failed or stopped already
                return
            updates = self._book.abort_all(FinishAbort(f"engine failed: {reason}"), self._now())
            self._changed.notify_all()
        log.error("engine failed: %s", reason)
        self.listener(updates)
        self._procs.stop(grace_s=0.0)
        if self.on_failure is not None:
            self.on_failure(reason)


def _dones(replies: list[Reply]) -> list[m.Done]:
    return [r for r in replies if isinstance(r, m.Done)]
