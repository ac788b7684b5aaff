"""The driver's bookkeeping, free of processes and threads: every request in flight and where it is, which
replica gets the next one, stop strings, finished lengths, the plan's triggers, and the planner snapshot.

The engine's ``step`` is a monotonic clock: every replica's step report advances it by one, and so does
every finish the driver decides itself (an abort of a request not yet on a replica) and every switch.
Finished lengths carry the step at which they were recorded, so ``snapshot(since_step)`` returns each one
exactly once to a reader that passes the step of its previous snapshot.

The driver (:mod:`rollout_worker.engine.driver.engine`) feeds it the ranks' reports under one lock and sends
the
commands it returns. Everything here is deterministic given the reports, and unit-tested directly.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_worker.api.plan import Plan, ReconfigEvent, Trigger
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.state import (
    EngineState,
    FinishedLengths,
    ReplicaRequests,
    RunningRequest,
    WaitingRequest,
)
from rollout_worker.engine.finish import Finish, FinishAbort, FinishLength, FinishStop
from rollout_worker.engine.messages import PromptLogprobs, StepReport, Switched, TokenOut
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

Decode = Callable[[list[int]], str]
FINISHED_KEPT = 8192  # finished lengths kept for the planner (the most recent ones)
# A request goes where a request with the same prompt is (its prefix is cached there) unless that replica
# has this many more unfinished requests than the least loaded one (sglang-router's cache-aware policy,
# with its balance threshold).
SAME_PROMPT_SLACK = 8


@dataclass(eq=False, slots=True)
class Tracked:
    """A request as the driver knows it."""

    spec: RequestSpec
    stop: tuple[str, ...]
    arrived: float
    status: str = "queued"  # queued (not yet on a replica) | waiting | running
    replica: int | None = None
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    placements: list[dict[str, Any]] = field(default_factory=list)  # {"layout", "replica", "step"}
    verify_ct: int = 0  # verify steps it took part in (speculative decoding)


@dataclass(frozen=True, slots=True)
class Update:
    """What a consumer of one request learns from one report."""

    rid: str
    tokens: tuple[TokenOut, ...] = ()
    prompt: PromptLogprobs | None = None
    cached: int | None = None  # prompt tokens found in the prefix cache (set when it is admitted)
    finish: Finish | None = None
    placements: tuple[dict[str, Any], ...] = ()  # set with the finish
    latency: tuple[float | None, float] | None = None  # (TTFT s or None, e2e s), set with the finish
    verify_ct: int = 0  # verify steps it took part in (SGLang's spec_verify_ct), set with the finish


@dataclass(slots=True)
class Outcome:
    """The result of feeding the table one report: consumer updates, aborts to send, token timings."""

    updates: list[Update] = field(default_factory=list)
    aborts: list[tuple[int, str, Finish]] = field(default_factory=list)  # (replica, rid, finish) to stop
    itl_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


class RequestTable:
    def __init__(self, layout: Layout, decode: Decode | None = None) -> None:
        self.layout, self.decode = layout, decode
        self.epoch = self.step = 0
        self.reqs: dict[str, Tracked] = {}
        self.queued: deque[str] = deque()
        self.plan: Plan | None = None
        self.events: list[ReconfigEvent] = []
        self.finished: deque[tuple[int, int, bool]] = deque(maxlen=FINISHED_KEPT)  # (step, length, capped)
        self.finished_total = 0
        self.step_ms: deque[float] = deque(maxlen=64)
        self.kv: dict[int, tuple[int, int]] = {}  # replica -> (KV tokens used, KV token slots allocated)
        self.prompt_tokens = self.generation_tokens = self.aborted = 0
        self.prefill_tokens = self.reused_tokens = 0  # computed by prefills / taken from the prefix cache
        # speculative decoding: a request's verify steps, and the tokens they emitted (accepted drafts and
        # the draw after them)
        self.spec_verifies = self.spec_tokens = 0
        self._same_prompt: dict[tuple[int, ...], str] = {}  # prompt -> the latest request dispatched with it
        # requests finished here (a stop string) that a replica still holds until it reports them finished:
        # their ids are not free yet, or that report would finish a new request of the same id
        self.leaving: set[str] = set()

    # -- admission and dispatch ------------------------------------------------------------------------
    def add(self, spec: RequestSpec, stop: tuple[str, ...], now: float) -> None:
        self.add_all([(spec, stop)], now)

    def add_all(self, jobs: Sequence[tuple[RequestSpec, tuple[str, ...]]], now: float) -> None:
        """Accept every request (with its stop strings), or none: an id already in flight, or given twice,
        is refused before anything changes."""
        seen: set[str] = set()
        for spec, _ in jobs:
            if spec.id in self.reqs or spec.id in self.leaving:
                raise UserError(f"a request with id {spec.id!r} is already in flight", "rid")
            if spec.id in seen:
                raise UserError(f"the id {spec.id!r} is given to more than one request of the batch", "rid")
            seen.add(spec.id)
        for spec, stop in jobs:
            self.reqs[spec.id] = Tracked(spec, stop, now)
            self.queued.append(spec.id)
            self.prompt_tokens += len(spec.prompt_ids)

    def load(self) -> list[int]:
        """Unfinished requests on each replica of the current layout."""
        out = [0] * self.layout.replicas
        for t in self.reqs.values():
            if t.replica is not None:
                out[t.replica] += 1
        return out

    def dispatch(self) -> list[tuple[int, RequestSpec]]:
        """Give every queued request a replica: that of an unfinished request with the same prompt (the
        samples of one prompt share its KV pages there) unless it is :data:`SAME_PROMPT_SLACK` requests
        busier than the least loaded; else the least loaded (lowest index on a tie)."""
        load, out = self.load(), []
        while self.queued:
            t = self.reqs[self.queued.popleft()]
            d = min(range(len(load)), key=lambda i: (load[i], i))
            kin = self.reqs.get(self._same_prompt.get(t.spec.prompt_ids, ""))
            if (
                kin is not None
                and kin.replica is not None
                and load[kin.replica] - load[d] < SAME_PROMPT_SLACK
            ):
                d = kin.replica
            self._same_prompt[t.spec.prompt_ids] = t.spec.id
            load[d] += 1
            t.status, t.replica = "waiting", d
            t.placements.append({"layout": str(self.layout), "replica": d, "step": self.step})
            out.append((d, t.spec))
        return out

    @property
    def unfinished(self) -> int:
        return len(self.reqs)

    @property
    def dispatched(self) -> int:
        return len(self.reqs) - len(self.queued)

    # -- reports ---------------------------------------------------------------------------------------
    def on_step(self, r: StepReport, now: float) -> Outcome:
        out = Outcome()
        self.step += 1
        if r.kind == "decode":
            self.step_ms.append(r.ms)
        current = r.epoch == self.epoch  # a report from before a switch still carries true tokens
        if current:
            self.kv[r.replica] = (r.kv_tokens, r.kv_capacity)
        self.prefill_tokens += r.prefill_tokens
        self.reused_tokens += r.reused_tokens
        for rid in r.admitted:
            t = self.reqs.get(rid)
            if t is not None and current:
                t.status = "running"
        for rid, n in r.cached.items():
            if rid in self.reqs:
                out.updates.append(Update(rid, cached=n))
        for rid in r.retracted:
            t = self.reqs.get(rid)
            if t is not None and current:
                t.status = "waiting"
        for rid, pl in r.prompt_logprobs.items():
            if rid in self.reqs:
                out.updates.append(Update(rid, prompt=pl))
        if r.kind == "verify":
            self._verified(r)
        for tok in r.tokens:
            self._token(tok, now, out)
        for rid, finish in r.finished:
            self.leaving.discard(rid)
            if rid in self.reqs:
                out.updates.append(self.finalize(rid, finish, now))
        return out

    def _verified(self, r: StepReport) -> None:
        for rid in dict.fromkeys(tok.rid for tok in r.tokens):
            t = self.reqs.get(rid)
            if t is not None:
                t.verify_ct += 1
                self.spec_verifies += 1
        self.spec_tokens += len(r.tokens)

    def _token(self, tok: TokenOut, now: float, out: Outcome) -> None:
        t = self.reqs.get(tok.rid)
        if t is None:  # finished already (a stop string matched): the rank has not heard yet
            return
        t.output.append(tok.token)
        self.generation_tokens += 1
        if t.first_token_at is None:
            t.first_token_at = now
            out.ttft_s.append(now - t.arrived)
        elif t.last_token_at is not None:
            out.itl_s.append(now - t.last_token_at)
        t.last_token_at = now
        out.updates.append(Update(tok.rid, tokens=(tok,)))
        finish = self._stop_finish(t)
        if finish is not None and t.replica is not None:
            out.aborts.append((t.replica, tok.rid, finish))
            out.updates.append(self.finalize(tok.rid, finish, now))
            self.leaving.add(tok.rid)

    def _stop_finish(self, t: Tracked) -> Finish | None:
        """A stop string matched; or the output could not be decoded to check (the request's own failure:
        it is aborted, the engine carries on)."""
        try:
            matched = self._stop_matched(t)
        except Exception as exc:
            return FinishAbort(
                f"request failed: decoding the output for stop strings: {type(exc).__name__}: {exc}"
            )
        return None if matched is None else FinishStop(matched)

    def _stop_matched(self, t: Tracked) -> str | None:
        """The first stop string the output now contains (checked on a tail that covers the newest token)."""
        if not t.stop or self.decode is None or len(t.output) < t.spec.min_new_tokens:
            return None
        window = 4 * max(len(s) for s in t.stop) + 4
        tail = self.decode(t.output[-window:])
        return next((s for s in t.stop if s in tail), None)

    def finalize(self, rid: str, finish: Finish, now: float, in_report: bool = True) -> Update:
        """Finish a request; outside a report (the driver decided it) the engine's step advances too, so
        that a reader of ``since_step`` sees every finish exactly once."""
        if not in_report:
            self.step += 1
        t = self.reqs.pop(rid)
        if t.status == "queued":
            self.queued.remove(rid)
        if self._same_prompt.get(t.spec.prompt_ids) == rid:
            del self._same_prompt[t.spec.prompt_ids]
        n = len(t.output)
        self.finished.append((self.step, n, isinstance(finish, FinishLength) and n >= t.spec.max_new_tokens))
        self.finished_total += 1
        if isinstance(finish, FinishAbort):
            self.aborted += 1
        ttft = None if t.first_token_at is None else t.first_token_at - t.arrived
        return Update(
            rid,
            finish=finish,
            placements=tuple(t.placements),
            latency=(ttft, now - t.arrived),
            verify_ct=t.verify_ct,
        )

    def on_switched(self, msg: Switched, time_s: float) -> ReconfigEvent:
        self.step += 1
        event = msg.event.model_copy(update={"time_s": round(time_s, 4), "step": self.step})
        self.events.append(event)
        if event.outcome == "committed":
            self.layout, self.epoch = event.dst, msg.epoch
            self.kv = {}
            for rid, replica, running in msg.placements:
                t = self.reqs.get(rid)
                if t is not None:
                    t.replica, t.status = replica, "running" if running else "waiting"
                    t.placements.append({"layout": str(self.layout), "replica": replica, "step": self.step})
        return event

    def abort_all(self, finish: Finish, now: float) -> list[Update]:
        return [self.finalize(rid, finish, now, in_report=False) for rid in list(self.reqs)]

    # -- the plan ------------------------------------------------------------------------------------
    def set_plan(self, plan: Plan | None) -> None:
        self.plan = plan

    def fire(self) -> Trigger | None:
        """The trigger that fires now, if any (:meth:`Plan.fire`); a trigger to the current layout fires
        without a switch."""
        if self.plan is None:
            return None
        trig, self.plan = self.plan.fire(self.unfinished, self.layout)
        return trig

    # -- the planner's view --------------------------------------------------------------------------
    def snapshot(
        self,
        since_step: int,
        time_s: float,
        ready: list[bool],
        paused: bool,
        switching: bool,
        version: str,
        loads: int = 0,
    ) -> EngineState:
        reps = [ReplicaRequests() for _ in range(self.layout.replicas)]
        queued: list[WaitingRequest] = []
        for rid, t in self.reqs.items():
            spec = t.spec
            if t.status == "running" and t.replica is not None:
                reps[t.replica].running.append(
                    RunningRequest(
                        rid=rid,
                        prompt_len=len(spec.prompt_ids),
                        generated=len(t.output),
                        max_new_tokens=spec.max_new_tokens,
                    )
                )
            else:
                w = WaitingRequest(
                    rid=rid,
                    prompt_len=len(spec.prompt_ids),
                    max_new_tokens=spec.max_new_tokens,
                    generated=len(t.output),
                )
                (reps[t.replica].waiting if t.replica is not None else queued).append(w)
        recent = [f for f in self.finished if f[0] > since_step]
        dropped = self.finished_total > len(self.finished) and (
            not self.finished or self.finished[0][0] > since_step
        )
        return EngineState(
            layout=self.layout,
            step=self.step,
            time_s=round(time_s, 4),
            ranks_ready=ready,
            paused=paused,
            reconfiguring=switching,
            step_ms=round(statistics.median(self.step_ms), 4) if self.step_ms else None,
            replicas=reps,
            queued=queued,
            finished=FinishedLengths(
                since_step=since_step,
                lengths=[f[1] for f in recent],
                capped=[f[2] for f in recent],
                total=self.finished_total,
                truncated=dropped,
            ),
            plan=self.plan,
            weight_version=version,
            weight_loads=loads,
            reconfigurations=sum(1 for e in self.events if e.outcome == "committed"),
        )
