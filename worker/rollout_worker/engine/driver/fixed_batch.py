"""A fixed batch of requests through the engine, in process: ``rolloutctl generate`` and the engine tests.

It is a client of the same :class:`~rollout_worker.engine.driver.engine.Engine` the HTTP server uses:
requests are
submitted, an optional plan of triggers decides layout changes, and outputs are collected from the updates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_worker.api.plan import Plan, ReconfigEvent, Trigger
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.state import EngineState
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.engine import Engine, Observer
from rollout_worker.engine.driver.lifecycle import Health
from rollout_worker.engine.driver.request_table import Update
from rollout_worker.engine.finish import Finish, finish_json
from rollout_worker.engine.messages import Faults, StepReport
from rollout_worker.engine.model.checkpoint_index import CheckpointIndex
from rollout_worker.errors import EngineError


@dataclass(slots=True)
class _Out:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    finish: Finish | None = None
    placements: tuple[dict[str, Any], ...] = ()
    cached: int = 0  # prompt tokens found in the prefix cache


class Collector:
    """Listener that accumulates every request's tokens until all have finished; ``on_finish`` is called
    (on the engine's reader thread) once per finished request."""

    def __init__(self, rids: Sequence[str], on_finish: Callable[[], None] | None = None) -> None:
        self.outs = {rid: _Out() for rid in rids}
        self.left = len(self.outs)
        self.done = threading.Event()
        self.on_finish = on_finish
        self._lock = threading.RLock()  # on_finish may read the counts
        if not self.left:
            self.done.set()

    def __call__(self, updates: list[Update]) -> None:
        with self._lock:
            for u in updates:
                out = self.outs.get(u.rid)
                if out is None or out.finish is not None:
                    continue
                if u.cached is not None:
                    out.cached = u.cached
                for tok in u.tokens:
                    out.output_ids.append(tok.token)
                    out.logprobs.append(tok.logprob)
                if u.finish is not None:
                    out.finish, out.placements = u.finish, u.placements
                    self.left -= 1
                    if self.left == 0:
                        self.done.set()
                    if self.on_finish is not None:
                        self.on_finish()

    def finished(self) -> int:
        with self._lock:
            return len(self.outs) - self.left

    def generated(self) -> int:
        with self._lock:
            return sum(len(o.output_ids) for o in self.outs.values())


class _Stage:
    """The listener of the stage running now (the requests run before, then the batch)."""

    def __init__(self, to: Collector) -> None:
        self.to = to

    def __call__(self, updates: list[Update]) -> None:
        self.to(updates)


@dataclass(slots=True)
class BatchResult:
    outputs: list[dict[str, Any]]  # in input order
    steps: int
    step_ms: list[float]  # every decode step of every replica
    reconfigs: list[ReconfigEvent]
    wall_s: float  # the whole call: ranks started, weights loaded, generation, shutdown
    gen_s: float = 0.0  # first request submitted -> last request finished
    prefill_ms: list[float] = field(default_factory=list)  # every prefill step of every replica
    retractions: int = 0  # requests retracted for want of KV pages
    verify_steps: int = 0  # decode steps that verified drafts (speculative decoding), every replica's
    verify_tokens: int = 0  # tokens those steps emitted (drafts accepted and the draw after them)
    verify_requests: int = 0  # requests those steps verified (a request in a step counts once)
    tail_s: float = 0.0  # the tail: from the moment three quarters of the requests had finished to the end
    tail_tokens: int = 0  # tokens generated in the tail

    def tokens(self) -> dict[str, list[int]]:
        """Each request's output ids, by request id."""
        return {o["id"]: o["output_ids"] for o in self.outputs}


class Interrupted(EngineError):
    """Stopped before every request finished; ``partial`` holds the ones that had."""

    def __init__(self, partial: list[dict[str, Any]], total: int) -> None:
        super().__init__(f"interrupted: {len(partial)} of {total} request(s) had finished")
        self.partial, self.total = partial, total


def _row(spec: RequestSpec, out: _Out) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": spec.id,
        "output_ids": out.output_ids,
        "finish_reason": finish_json(out.finish),
        "prompt_tokens": len(spec.prompt_ids),
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached,
        "placements": list(out.placements),
        "layouts": list(dict.fromkeys(p["layout"] for p in out.placements)),
    }
    if spec.return_logprob:
        row["output_token_logprobs"] = out.logprobs
    return row


def run_batch(
    cfg: EngineConfig,
    specs: list[RequestSpec],
    triggers: Sequence[Trigger] = (),
    on_progress: Callable[[EngineState, int], None] | None = None,
    progress_every_s: float = 1.0,
    on_reconfig: Callable[[ReconfigEvent], None] | None = None,
    faults: Faults | None = None,
    concurrency: int | None = None,
    before: Sequence[RequestSpec] = (),
) -> BatchResult:
    """Generate every request; ``triggers`` form the plan (switch when unfinished drops to n or fewer).
    With ``concurrency``, at most that many requests are in flight: a new one is submitted as one finishes
    (a closed loop, as that many clients of a server would run). ``before``: requests the same engine runs
    to the end first (an earlier iteration of an RL loop), outside the result and its timing."""
    CheckpointIndex(cfg.model_dir, cfg.model).verify()  # fail before starting any rank
    pending = list(reversed(specs))
    engine: Engine | None = None
    tail_at = len(specs) - len(specs) // 4  # finished requests at which the tail starts
    tail: list[tuple[float, int]] = []  # (time, tokens generated) when it started

    def next_one() -> None:
        if pending and engine is not None:
            engine.submit(pending.pop())

    def on_finish() -> None:
        if concurrency:
            next_one()
        if not tail and col.finished() >= tail_at:
            tail.append((time.perf_counter(), col.generated()))

    col = Collector([s.id for s in specs], on_finish=on_finish)
    first = Collector([s.id for s in before])
    step_ms: list[float] = []
    prefill_ms: list[float] = []
    retractions = verify_steps = verify_tokens = verify_requests = 0

    def on_report(r: StepReport) -> None:
        nonlocal retractions, verify_steps, verify_tokens, verify_requests
        if r.kind == "decode":
            step_ms.append(r.ms)
        elif r.kind == "prefill":
            prefill_ms.append(r.ms)
        elif r.kind == "verify":
            verify_steps += 1
            verify_tokens += len(r.tokens)
            verify_requests += len({t.rid for t in r.tokens})
        retractions += r.retractions

    t0 = time.perf_counter()
    observer = Observer(on_report=on_report, on_switch=on_reconfig)
    listener = _Stage(first if before else col)
    engine = Engine(cfg, listener=listener, observer=observer, faults=faults)
    try:
        engine.start()
        if before:
            for spec in before:
                engine.submit(spec)
            while not first.done.wait(0.1) and engine.status.health is not Health.FAILED:
                pass
            if engine.status.health is Health.FAILED:
                raise EngineError(engine.status.failure or "engine failed")
            listener.to = col
            step_ms.clear()
            prefill_ms.clear()
            retractions = verify_steps = verify_tokens = verify_requests = 0
        t_gen = time.perf_counter()
        for _ in range(min(len(pending), concurrency or len(pending))):
            next_one()
        if triggers:  # after the requests: a plan set on an empty engine would fire at once
            engine.set_plan(Plan(based_on_layout=cfg.layout, triggers=list(triggers)))
        last = time.monotonic()
        while not col.done.wait(0.1):
            if on_progress is not None and time.monotonic() - last >= progress_every_s:
                on_progress(engine.state(), col.finished())
                last = time.monotonic()
        t_end = time.perf_counter()
        gen_s = t_end - t_gen
        status = engine.status
        if status.health is Health.FAILED:
            raise EngineError(status.failure or "engine failed")
        steps, events = engine.state().step, engine.reconfigurations()
    except KeyboardInterrupt:
        done = [_row(s, col.outs[s.id]) for s in specs if col.outs[s.id].finish is not None]
        raise Interrupted(done, len(specs)) from None
    finally:
        engine.shutdown()
    outputs = [_row(s, col.outs[s.id]) for s in specs]
    return BatchResult(
        outputs,
        steps,
        step_ms,
        events,
        time.perf_counter() - t0,
        gen_s,
        prefill_ms,
        retractions,
        verify_steps,
        verify_tokens,
        verify_requests,
        t_end - tail[0][0] if tail else 0.0,
        col.generated() - tail[0][1] if tail else 0,
    )
