"""The engine as a library: a driver object in the caller's process that owns G long-lived rank processes.

Verbs (thread-safe; the slow ones block their caller, never the reader thread): ``submit`` (generate),
``abort``, ``pause`` / ``resume``, ``set_plan``, ``reconfigure``, ``state``, ``update_weights``,
``join_weight_group`` / ``leave_weight_group``, ``release_memory`` / ``resume_memory``, ``add_corpus`` /
``remove_corpus``, ``shutdown``;
``snapshot``, ``status`` and what the engine is doing (``paused``, ``released``, ``joining``) for readers.
Progress reaches the caller through ``listener``, called on the driver's reader thread once per rank report
with the updates of every request it touched. The HTTP server and ``rolloutctl generate`` are both clients
of this one object.

This module holds the lifecycle, the readers' view and the request verbs. The driver's parts share one
:class:`~rollout_worker.engine.driver.shared.Shared` (the requests, health, tickets, switching and rank
processes behind one lock, the engine's flags, and the one shape of a command every rank answers); the
weight verbs are :mod:`~rollout_worker.engine.driver.weight_verbs`, the memory verbs
:mod:`~rollout_worker.engine.driver.memory_verbs`, and the reader thread that applies the ranks' reports
:mod:`~rollout_worker.engine.driver.reader`. The reader thread takes the lock only to apply a report, and
calls the listener and the observer outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.requests import RequestSpec, check_fits
from rollout_worker.api.state import EngineState
from rollout_worker.engine import messages as m
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver import memory_verbs, snapshot
from rollout_worker.engine.driver.corpus_verbs import CorpusVerbs
from rollout_worker.engine.driver.lifecycle import Health, Status
from rollout_worker.engine.driver.reader import Observer, Reader
from rollout_worker.engine.driver.request_table import Decode, Update
from rollout_worker.engine.driver.shared import Listener, NothingToSend, Shared
from rollout_worker.engine.driver.weight_groups import Joining
from rollout_worker.engine.driver.weight_verbs import WeightVerbs
from rollout_worker.engine.finish import PAUSE_ABORT, FinishAbort
from rollout_worker.engine.messages import Faults
from rollout_worker.errors import EngineError, Unavailable, UserError
from rollout_worker.scheduling.costs import Method
from rollout_worker.scheduling.layout import Layout

__all__ = ["Engine", "Listener", "Observer"]


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
        self._shared = Shared(cfg, decode, faults, listener or (lambda updates: None), on_failure)
        self._reader = Reader(self._shared, observer or Observer())
        self._corpora = CorpusVerbs(self._shared)
        self._weights = WeightVerbs(self._shared, lambda message: self.abort(None, message))

    @property
    def listener(self) -> Listener:
        return self._shared.listener

    @property
    def on_failure(self) -> Callable[[str], None] | None:
        return self._shared.on_failure

    @property
    def observer(self) -> Observer:
        return self._reader.observer

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout_s: float = 900.0) -> Engine:
        """Start the ranks and wait until every one has loaded its weights."""
        shared = self._shared
        shared.procs.start()
        self._reader.thread.start()
        with shared.lock:
            started = shared.changed.wait_for(
                lambda: shared.life.status.health is not Health.STARTING, timeout_s
            )
        if not started:
            shared.fail(f"ranks not ready after {timeout_s:.0f} s")
        status = shared.life.status
        if not status.serving:
            self._reader.thread.join(timeout=5)
            raise EngineError(status.failure or "engine failed to start")
        shared.t0 = time.monotonic()
        return self

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop: optionally let in-flight requests finish, abort the rest, stop every rank."""
        shared = self._shared
        with shared.lock:
            was_failed = shared.life.status.health is Health.FAILED
            if not shared.life.move(Health.STOPPING):  # stopping or stopped already
                return
            shared.changed.notify_all()
            if drain_timeout_s > 0 and not was_failed:
                shared.changed.wait_for(lambda: shared.table.unfinished == 0, drain_timeout_s)
            updates = shared.table.abort_all(FinishAbort("engine shutting down"), shared.now())
            shared.changed.notify_all()
        shared.listener(updates)
        shared.procs.stop(grace_s=0.0 if was_failed else 10.0)
        reader = self._reader.thread
        if reader.is_alive() and threading.current_thread() is not reader:
            reader.join(timeout=5)
        with shared.lock:
            shared.life.move(Health.STOPPED)
            shared.changed.notify_all()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- what readers see (no lock needed: immutable values) -------------------------------------------
    @property
    def status(self) -> Status:
        return self._shared.life.status

    @property
    def layout(self) -> Layout:
        return self._shared.table.layout

    @property
    def weight_version(self) -> str:
        return self._shared.flags.weight_version

    @property
    def paused(self) -> str | None:
        """The pause mode while paused."""
        return self._shared.flags.paused

    @property
    def released(self) -> tuple[str, ...]:
        """The memory tags released (from the moment a release is sent until a resume of them returns)."""
        return tuple(sorted(self._shared.flags.released))

    @property
    def joining(self) -> tuple[Joining, ...]:
        """Joins of trainers' groups under way."""
        return self._shared.groups.joining

    @property
    def memory_held(self) -> tuple[m.MemoryHeld | None, ...]:
        """Per rank, the bytes it held when it last said (once started, and after each release / resume)."""
        return self._shared.flags.held

    @property
    def rank_pids(self) -> list[int | None]:
        return [p.pid for p in self._shared.procs.procs]

    def snapshot(self) -> snapshot.Snapshot:
        """Health, layout, requests per replica and KV use, taken together."""
        shared = self._shared
        with shared.lock:
            return snapshot.take(
                shared.table, shared.life.status, shared.flags.paused, shared.flags.weight_version
            )

    def state(self, since_step: int = 0) -> EngineState:
        shared, flags = self._shared, self._shared.flags
        with shared.lock:
            ready = shared.life.status.serving and not shared.switching.in_flight
            return shared.table.snapshot(
                since_step,
                shared.now() - shared.t0,
                [ready and r in flags.ready for r in range(self.cfg.world)],
                flags.paused is not None,
                shared.switching.in_flight,
                flags.weight_version,
                flags.weight_loads,
            )

    def reconfigurations(self) -> list[ReconfigEvent]:
        with self._shared.lock:
            return list(self._shared.table.events)

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
        shared = self._shared
        with shared.lock:
            shared.check_serving()
            if released := shared.flags.released:
                raise Unavailable(f"memory released ({', '.join(sorted(released))}); resume it first")
            shared.table.add_all(jobs, shared.now())
            shared.dispatch()

    def abort(self, rid: str | Collection[str] | None = None, message: str = "aborted by request") -> int:
        """Abort one request, several (unknown ids are a no-op) or all (``rid=None``). Partial output is
        kept."""
        finish, shared = FinishAbort(message), self._shared
        with shared.lock:
            table = shared.table
            asked = table.reqs if rid is None else [rid] if isinstance(rid, str) else dict.fromkeys(rid)
            rids = [r for r in asked if r in table.reqs]
            on_ranks = [r for r in rids if table.reqs[r].replica is not None]
            updates = [
                table.finalize(r, finish, shared.now(), in_report=False)
                for r in rids
                if table.reqs[r].replica is None
            ]
            if on_ranks:  # to every rank: a switch may be moving the request to another replica right now
                shared.procs.broadcast(m.Abort(tuple(on_ranks), finish))
            if updates:
                shared.changed.notify_all()
        shared.listener(updates)
        return len(rids)

    def pause(self, mode: str = "abort") -> None:
        if mode not in m.PAUSE_MODES:
            raise UserError(f"must be one of {', '.join(m.PAUSE_MODES)}, got {mode!r}", "mode")
        updates: list[Update] = []
        shared = self._shared
        with shared.lock:
            shared.check_serving()
            shared.flags.paused = mode
            shared.procs.broadcast(m.Pause(mode))
            if mode == "abort":  # the ranks abort theirs; the driver, those not on a replica yet
                updates = [
                    shared.table.finalize(r, PAUSE_ABORT, shared.now()) for r in list(shared.table.queued)
                ]
            shared.changed.notify_all()  # a weight update waiting for requests in flight goes ahead now
        shared.listener(updates)

    def resume(self) -> None:
        shared = self._shared
        with shared.lock:
            shared.check_serving()
            shared.flags.paused = None
            shared.procs.broadcast(m.Resume())
            shared.dispatch()

    def set_plan(self, plan: Plan | None) -> None:
        """Replace the plan. Refused (409) unless ``plan.based_on_layout`` is the current layout."""
        shared = self._shared
        with shared.lock:
            shared.check_serving()
            shared.switching.set_plan(plan)
            shared.fire()

    def reconfigure(
        self, layout: Layout, method: Method = "auto", timeout_s: float | None = None
    ) -> ReconfigEvent | None:
        """Switch to ``layout`` at the next step boundary of every replica; cancels the plan. Returns the
        event (None when already in that layout)."""
        shared = self._shared
        shared.switching.check_layout(layout, "layout")

        def check() -> None:
            shared.check_serving()
            shared.switching.set_plan(None)
            if layout == shared.table.layout:
                raise NothingToSend

        with shared.one_at_a_time:
            try:
                ticket, _ = shared.send(
                    lambda t: m.Reconfigure(layout, method, "requested", t), 1, check, shared.switching.began
                )
            except NothingToSend:
                return None
            return next(r for r in shared.await_(ticket, timeout_s) if isinstance(r, ReconfigEvent))

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
        return self._weights.load(make, version, abort_all, timeout_s, "model_path")

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
        return self._weights.load(cmd, version, abort_all, timeout_s, "names", group_name)

    def check_weight_group(self, name: str) -> None:
        """Refuse a trainer's group every rank has not joined: unknown (400) or still joining (409)."""
        self._weights.check_group(name)

    def join_weight_group(self, join: Callable[[int], m.JoinWeightGroup]) -> None:
        """Every rank joins a trainer's group beside its step loop (generation goes on meanwhile). Returns
        once every rank has joined; after the first rank that could not, or after the join's timeout, every
        rank leaves the group again and a UserError naming ``master_address`` says why."""
        self._weights.join_group(join)

    def leave_weight_group(self, name: str) -> None:
        """Every rank leaves a trainer's group it joined, at its next step boundary."""
        self._weights.leave_group(name)

    def set_weight_version(self, version: str, abort_all: bool = False) -> None:
        """Name the weights being served (what ``meta_info.weight_version`` reports), aborting every
        request first with ``abort_all``."""
        self._weights.set_version(version, abort_all)

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Every rank frees the memory of ``tags``; returns once every rank has (refused while requests are
        in flight). New requests are refused (503) from the moment the ranks are told until a resume of
        these tags returns."""
        memory_verbs.release_or_resume(self._shared, m.ReleaseMemory, tags)

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Every rank takes the memory of ``tags`` again; returns once every rank holds it."""
        memory_verbs.release_or_resume(self._shared, m.ResumeMemory, tags)

    def flush_cache(self) -> None:
        """Empty every replica's prefix cache (refused while requests are in flight)."""
        memory_verbs.flush_cache(self._shared)

    def add_corpus(self, corpus_id: str, documents: Sequence[Sequence[int]]) -> int:
        """Every rank adds ``documents`` (token ids) to speculative decoding's external corpus under
        ``corpus_id``; returns the tokens added (refused when speculation is off, the id is taken, or the
        corpora would exceed their bound)."""
        return self._corpora.add(corpus_id, documents)

    def remove_corpus(self, corpus_id: str) -> None:
        """Every rank drops the external corpus ``corpus_id`` (refused when there is none)."""
        self._corpora.remove(corpus_id)

    def corpora(self) -> dict[str, int]:
        """The external corpora held: id -> tokens."""
        return self._corpora.held()
