"""One reconciliation of a RolloutJob, as a pure function: what the API and the sidecars showed this tick
(``Observed``) -> what to do (``Actions``: pods to make and to delete, the new status, the Events).

Levels, not events: everything the next tick needs is in the status it returns, so an operator that
restarts mid-job carries on from the object. The phases (``status.phase``):

    Pending -> Running -> Succeeded            every pod's sidecar reports its shard written
    any     -> Suspended -> Pending ...        spec.suspend true: pods deleted; false: made again (resume)
    any     -> Failed                          backoffLimit pod failures, the deadline, or a refused spec

A reconfiguration is a condition (Reconfiguring) and an Event, not a phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from rollout_worker.api.sidecar import Progress

from rollout_operator.api import cluster as k
from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.api.status import Condition, ConditionType, PodProgress, RolloutJobStatus

FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class PodView:
    """A pod as the API shows it."""

    index: int
    name: str
    uid: str
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ip: str | None
    ready: bool
    deleting: bool
    message: str = ""


def pod_view(obj: dict[str, Any]) -> PodView | None:
    """Parse a Pod object of a job (None: not one of its pods)."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    raw = (meta.get("labels") or {}).get(k.LABEL_POD_INDEX)
    if raw is None or not str(raw).isdigit():
        return None
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    why = [status.get("message") or ""]
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            why.append(f"container {cs.get('name')} exited with code {term.get('exitCode')}")
    return PodView(
        int(raw),
        meta.get("name", ""),
        meta.get("uid", ""),
        status.get("phase") or "Pending",
        status.get("podIP"),
        ready,
        bool(meta.get("deletionTimestamp")),
        "; ".join(w for w in why if w),
    )


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    name: str  # the job's
    spec: RolloutJobSpec
    status: RolloutJobStatus
    generation: int
    now: datetime
    pods: dict[int, PodView]
    progress: dict[int, Progress]  # the sidecars that answered this tick
    unreachable_s: dict[int, float]  # pods whose sidecar has not answered since this many seconds
    degraded_after_s: float
    reconfiguring: bool = False  # a pushed plan whose switch has not been seen yet


@dataclass
class Actions:
    status: RolloutJobStatus
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    finished: Literal["succeeded", "failed"] | None = None  # the job ended this tick


def iso(t: datetime) -> str:
    return t.isoformat(timespec="seconds").replace("+00:00", "Z")


def _parse(t: str | None) -> datetime | None:
    return None if t is None else datetime.fromisoformat(t.replace("Z", "+00:00"))


def set_condition(
    st: RolloutJobStatus, type_: ConditionType, on: bool, reason: str, message: str, now: datetime, gen: int
) -> bool:
    """Set a condition; True when its status changed (lastTransitionTime moves only then)."""
    value: Literal["True", "False"] = "True" if on else "False"
    for i, c in enumerate(st.conditions):
        if c.type == type_:
            changed = c.status != value
            when = iso(now) if changed else c.last_transition_time
            st.conditions[i] = _condition(type_, value, reason, message, when, gen)
            return changed
    st.conditions.append(_condition(type_, value, reason, message, iso(now), gen))
    return on


def _condition(
    type_: ConditionType, value: Literal["True", "False"], reason: str, message: str, when: str, gen: int
) -> Condition:
    return Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=when,
        observed_generation=gen,
    )


def condition(st: RolloutJobStatus, type_: ConditionType) -> bool:
    return any(c.type == type_ and c.status == "True" for c in st.conditions)


def _pods(obs: Observed) -> list[PodProgress]:
    old = {p.index: p for p in obs.status.pods}
    out = []
    for i in range(obs.spec.pods):
        p = old.get(i) or PodProgress(index=i, name=k.pod_name(obs.name, i))
        view, prog = obs.pods.get(i), obs.progress.get(i)
        upd: dict[str, Any] = {}
        if view is not None:
            upd["ip"] = view.ip
            if view.uid != p.uid:  # a new pod: its engine counts from zero
                upd |= {"uid": view.uid, "reconfigurations": 0, "step": 0}
        upd["reachable"] = prog is not None
        if prog is not None:
            upd |= {
                "layout": prog.layout,
                "samples_done": prog.samples_done,
                "samples_total": prog.samples_total or 0,
                "running": prog.running,
                "waiting": prog.waiting,
            }
        upd["ready"] = bool(view and view.ready and prog is not None and prog.engine_ready)
        out.append(p.model_copy(update=upd))
    return out


def _summary(st: RolloutJobStatus, service: bool) -> None:
    layouts = sorted({p.layout for p in st.pods if p.layout}, key=lambda x: (len(x), x))
    st.layout = ",".join(layouts) if layouts else None
    st.samples_done = sum(p.samples_done for p in st.pods)
    st.samples_total = sum(p.samples_total for p in st.pods)
    st.tokens = sum(p.tokens for p in st.pods)
    st.progress = str(st.samples_done) if service else f"{st.samples_done}/{st.samples_total}"


def _fail(acts: Actions, obs: Observed, reason: str, message: str) -> Actions:
    st = acts.status
    st.phase, st.message = "Failed", message
    st.completion_time = iso(obs.now)
    gen = obs.generation
    set_condition(st, "Failed", True, reason, message, obs.now, gen)
    set_condition(st, "Progressing", False, reason, message, obs.now, gen)
    set_condition(st, "Ready", False, reason, message, obs.now, gen)
    acts.delete = sorted(v.name for v in obs.pods.values() if not v.deleting)
    acts.events.append(Event("Warning", "Failed", message))
    acts.finished = "failed"
    return acts


def reconcile(obs: Observed) -> Actions:
    st = obs.status.model_copy(deep=True)
    st.observed_generation = obs.generation
    acts = Actions(st)
    spec, now, gen = obs.spec, obs.now, obs.generation
    live = {i: v for i, v in obs.pods.items() if not v.deleting}
    if st.phase in FINISHED:  # nothing runs after the end; stragglers (an earlier delete failed) go
        acts.delete = sorted(v.name for v in live.values())
        return acts
    st.pods = _pods(obs)
    _summary(st, spec.mode == "service")

    if spec.suspend:
        acts.delete = sorted(v.name for v in live.values())
        if st.phase != "Suspended":
            st.phase = "Suspended"
            set_condition(st, "Suspended", True, "Suspended", "spec.suspend is true", now, gen)
            set_condition(st, "Ready", False, "Suspended", "the pods are deleted", now, gen)
            set_condition(st, "Progressing", False, "Suspended", "spec.suspend is true", now, gen)
            acts.events.append(Event("Normal", "Suspended", "pods deleted; the outputs stay for the resume"))
        return acts
    if st.phase == "Suspended":
        st.phase, st.start_time = "Pending", iso(now)  # the deadline counts again from the resume
        set_condition(st, "Suspended", False, "Resumed", "spec.suspend is false", now, gen)
        acts.events.append(Event("Normal", "Resumed", "making the pods again; they resume from the outputs"))

    deadline = spec.active_deadline_seconds
    started = _parse(st.start_time)
    if deadline is not None and started is not None and (now - started).total_seconds() > deadline:
        return _fail(acts, obs, "DeadlineExceeded", f"the job ran longer than {deadline} s")

    # failed pods: counted once each (by uid), deleted, made again until backoffLimit
    for i, v in live.items():
        if v.phase not in ("Failed", "Succeeded"):
            continue
        p = st.pods[i]
        if p.last_failed_uid != v.uid:
            why = v.message or f"pod ended ({v.phase})"
            st.pods[i] = p.model_copy(
                update={"restarts": p.restarts + 1, "last_failed_uid": v.uid, "last_failure": why}
            )
            failures = sum(x.restarts for x in st.pods)
            if failures > spec.backoff_limit:
                msg = f"pod {v.name} failed ({why}); {failures} pod failures exceed backoffLimit"
                return _fail(acts, obs, "BackoffLimitExceeded", f"{msg} {spec.backoff_limit}")
            again = f"making it again ({failures} of backoffLimit {spec.backoff_limit})"
            acts.events.append(Event("Warning", "PodFailed", f"pod {v.name} failed ({why}); {again}"))
        acts.delete.append(v.name)
    gone = set(acts.delete)
    # a pod still being deleted (not ours to count) is made again once it is gone
    acts.create = [i for i in range(spec.pods) if i not in obs.pods or obs.pods[i].name in gone]

    _degraded(acts, obs)  # before the end: a sidecar back in the last tick is a recovery all the same
    answered = obs.progress.values()
    done = spec.mode == "job" and len(answered) == spec.pods and all(p.done for p in answered)
    if done:
        st.phase, st.completion_time = "Succeeded", iso(now)
        if started is not None:
            st.generation_seconds = round((now - started).total_seconds(), 3)
        msg = f"{st.samples_done} samples written to {spec.output.path}"
        set_condition(st, "Complete", True, "Completed", msg, now, gen)
        set_condition(st, "Progressing", False, "Completed", msg, now, gen)
        set_condition(st, "Ready", False, "Completed", "the pods are deleted", now, gen)
        set_condition(st, "Reconfiguring", False, "Completed", "", now, gen)
        acts.delete, acts.create = sorted(v.name for v in live.values()), []
        acts.events.append(Event("Normal", "Completed", msg))
        acts.finished = "succeeded"
        return acts

    running = all(i in live and live[i].phase == "Running" for i in range(spec.pods))
    st.phase = "Running" if running else "Pending"
    ready = all(p.ready for p in st.pods)
    set_condition(st, "Ready", ready, "PodsReady" if ready else "PodsNotReady", "", now, gen)
    set_condition(st, "Progressing", True, "Generating" if running else "CreatingPods", "", now, gen)
    switching = obs.reconfiguring
    set_condition(st, "Reconfiguring", switching, "PlanPushed" if switching else "Idle", "", now, gen)
    return acts


def _degraded(acts: Actions, obs: Observed) -> None:
    st, now, gen = acts.status, obs.now, obs.generation
    away = sorted(
        st.pods[i].name
        for i, s in obs.unreachable_s.items()
        if s >= obs.degraded_after_s and i in obs.pods and obs.pods[i].phase == "Running"
    )
    was = condition(st, "Degraded")
    if away:
        msg = f"sidecar unreachable: {', '.join(away)}"
        set_condition(st, "Degraded", True, "SidecarUnreachable", msg, now, gen)
        if not was:
            acts.events.append(Event("Warning", "Degraded", msg))
    elif was:
        set_condition(st, "Degraded", False, "Recovered", "every sidecar answers", now, gen)
        acts.events.append(Event("Normal", "Recovered", "every sidecar answers again"))
