"""The operator's handlers, called by the kopf decorators in ``main``: what happens when a RolloutJob is
created, on each tick of its timer, and when it is deleted. The decisions are pure (``cluster.plan``,
``cluster.reconcile``, ``cluster.decisions``); this module reads the world, calls them and carries out
what they return."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.profile import Profile
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from rollout_operator.api import cluster as k
from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.api.status import RolloutJobStatus
from rollout_operator.cluster.decisions import apply_ticks
from rollout_operator.cluster.manifests import JobRef, PodPlan, build_pod, build_secret, build_service
from rollout_operator.cluster.plan import Refusal, check_cluster_fields, parse_spec, plan_pods
from rollout_operator.cluster.reconcile import (
    FINISHED,
    Event,
    Observed,
    iso,
    pod_view,
    reconcile,
    set_condition,
)
from rollout_operator.cluster.settings import OperatorSettings
from rollout_operator.control.jobplan import JobPlan
from rollout_operator.control.profiles import find_profile
from rollout_operator.control.records import DbRecorder, end_job, prior_for_model, start_job
from rollout_operator.kube.client import Kube
from rollout_operator.kube.metrics import OperatorMetrics
from rollout_operator.kube.runtime import JobRuntime

log = logging.getLogger(__name__)
Body = dict[str, Any]
PostEvent = Callable[[Body, Event], None]


@dataclass
class Job:
    """A running job's in-memory part (rebuilt from the object after a restart)."""

    plan: PodPlan
    runtime: JobRuntime


@dataclass
class Context:
    settings: OperatorSettings
    kube: Kube
    db: Engine
    metrics: OperatorMetrics
    post: PostEvent  # kopf.event, or a stand-in
    jobs: dict[str, Job] = field(default_factory=dict)  # by the RolloutJob's uid
    swept: set[str] = field(default_factory=set)  # finished jobs checked for stray pods since the start


def _now() -> datetime:
    return datetime.now(UTC)


def _ref(body: Body) -> JobRef:
    meta = body["metadata"]
    return JobRef(meta["name"], meta["namespace"], meta["uid"], dict(meta.get("labels") or {}))


def _generation(body: Body) -> int:
    return int(body["metadata"].get("generation") or 1)


def _status(body: Body) -> RolloutJobStatus:
    try:
        return RolloutJobStatus.model_validate(body.get("status") or {})
    except ValidationError:  # written by something else: start from a clean status
        log.warning("%s: status unreadable; starting from a clean one", body["metadata"]["name"])
        return RolloutJobStatus()


def _profile_and_plan(
    ctx: Context, name: str, spec: RolloutJobSpec
) -> tuple[Profile | None, tuple[PodPlan, JobPlan] | Refusal]:
    refusal = check_cluster_fields(name, spec)
    if refusal is not None:
        return None, refusal
    with Session(ctx.db) as session:
        profile = find_profile(spec, session, ctx.settings.profiles_dir)
    if isinstance(profile, Refusal):
        return None, profile
    return profile, plan_pods(spec, profile, ctx.settings.pod_listen)


def _refuse(ctx: Context, body: Body, status: RolloutJobStatus, refusal: Refusal) -> RolloutJobStatus:
    now, gen = _now(), _generation(body)
    status.phase, status.message = "Failed", f"invalid: {refusal}"
    status.observed_generation = gen
    set_condition(status, "Failed", True, "InvalidSpec", str(refusal), now, gen)
    ctx.post(body, Event("Warning", "InvalidSpec", str(refusal)))
    ctx.metrics.refused.inc()
    return status


async def on_create(ctx: Context, body: Body) -> dict[str, Any]:
    """Check the job beyond the schema (a refusal: a condition and an Event, nothing made); make its
    Secret and headless Service and record it in the database. The timer makes the pods."""
    job, status = _ref(body), _status(body)
    spec = parse_spec(body.get("spec") or {})
    if isinstance(spec, Refusal):
        return _dump(_refuse(ctx, body, status, spec))
    profile, planned = _profile_and_plan(ctx, job.name, spec)
    if isinstance(planned, Refusal):
        return _dump(_refuse(ctx, body, status, planned))
    plan = planned[0]
    await ctx.kube.create(build_secret(job, secrets.token_urlsafe(24), secrets.token_urlsafe(24)))
    await ctx.kube.create(build_service(job))
    if status.record_id is None:
        shape = profile.model.shape_hash if profile is not None else ""
        status.record_id = start_job(ctx.db, job.name, job.namespace, spec, shape)
    now, gen = _now(), _generation(body)
    status.phase, status.start_time, status.observed_generation = "Pending", iso(now), gen
    status.output = spec.output.path if spec.mode == "job" else None
    status.layout_plan = f"{plan.layout} ({','.join(map(str, plan.candidates))})"
    set_condition(status, "Progressing", True, "CreatingPods", "", now, gen)
    ctx.post(body, Event("Normal", "Created", f"secret, service; pods start as {plan.layout}"))
    ctx.metrics.created.inc()
    return _dump(status)


def _dump(status: RolloutJobStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True)


async def _job(ctx: Context, body: Body, spec: RolloutJobSpec, status: RolloutJobStatus) -> Job | None:
    uid = body["metadata"]["uid"]
    if uid in ctx.jobs:
        return ctx.jobs[uid]
    ref = _ref(body)
    profile, planned = _profile_and_plan(ctx, ref.name, spec)
    if isinstance(planned, Refusal):
        log.warning("%s: %s", ref.name, planned)
        return None
    plan, job_plan = planned
    values = await ctx.kube.secret(ref.namespace, k.secret_name(ref.name))
    if values is None:
        log.warning("%s: its secret %s is missing", ref.name, k.secret_name(ref.name))
        return None
    prior = _prior(ctx, profile)
    recorder = DbRecorder(ctx.db, status.record_id)
    runtime = JobRuntime.start(
        values[k.SECRET_SIDECAR_TOKEN], status, job_plan.latency, job_plan.policy, prior, recorder,
        ctx.settings.sidecar_timeout_seconds,
    )  # fmt: skip
    ctx.jobs[uid] = Job(plan, runtime)
    return ctx.jobs[uid]


def _prior(ctx: Context, profile: Profile | None) -> Prior | None:
    if profile is None:
        return None
    with Session(ctx.db) as session:
        return prior_for_model(session, profile.model.shape_hash)


async def on_tick(ctx: Context, body: Body) -> dict[str, Any] | None:
    """Reconcile once: the pods against the spec, progress into the status, the planner on each pod.
    Returns the new status when it changed (None: nothing to write)."""
    status, ref = _status(body), _ref(body)
    if status.layout_plan is None:  # the create handler has not finished (it will be retried)
        return None
    now = _now()
    if status.phase in FINISHED:
        await _after_end(ctx, body, status, now)
        return None
    spec = parse_spec(body.get("spec") or {})
    if isinstance(spec, Refusal):
        log.warning("%s: %s", ref.name, spec)
        return None
    job = await _job(ctx, body, spec, status)
    if job is None:
        return None
    rt = job.runtime
    views = {v.index: v for v in map(pod_view, await ctx.kube.pods(ref.namespace, ref.name)) if v}
    progress = {} if spec.suspend else await rt.poll(views)
    ticks = await rt.plan(progress) if status.phase == "Running" and not spec.suspend else []
    obs = Observed(
        ref.name, spec, status, _generation(body), now, views, progress,
        rt.unreachable_s(), ctx.settings.degraded_after_seconds, bool(rt.awaiting_switch),
    )  # fmt: skip
    acts = reconcile(obs)
    events = acts.events
    if acts.finished is None:
        events += apply_ticks(acts.status, ticks, now)
        acts.status.tokens = sum(p.tokens for p in acts.status.pods)
    for name in acts.delete:
        await ctx.kube.delete_pod(ref.namespace, name)
    for i in acts.create:
        await ctx.kube.create(build_pod(ref, spec, i, job.plan))
        ctx.metrics.pods_created.inc()
    for ev in events:
        ctx.post(body, ev)
        ctx.metrics.event(ev.reason)
    if acts.finished is not None:
        await _finish(ctx, body, acts.status, acts.finished)
    new = _dump(acts.status)
    return None if new == _dump(status) else new


async def _finish(ctx: Context, body: Body, status: RolloutJobStatus, outcome: str) -> None:
    """The job ended: its record and finished lengths into the database; its memory goes."""
    job = ctx.jobs.pop(body["metadata"]["uid"], None)
    lengths, capped = job.runtime.lengths() if job is not None else ([], [])
    if job is not None:
        await job.runtime.close()
    if status.record_id is not None:
        end_job(ctx.db, status.record_id, outcome, status.generation_seconds, lengths, capped)
    ctx.metrics.finished.labels(outcome).inc()


async def _after_end(ctx: Context, body: Body, status: RolloutJobStatus, now: datetime) -> None:
    """A finished job: no pod stays (checked once per operator start: the pods are deleted before the
    phase is written); deleted after its TTL."""
    ref = _ref(body)
    if ref.uid not in ctx.swept:
        for pod in await ctx.kube.pods(ref.namespace, ref.name):
            await ctx.kube.delete_pod(ref.namespace, pod["metadata"]["name"])
        ctx.swept.add(ref.uid)
    ttl = (body.get("spec") or {}).get("ttlSecondsAfterFinished")
    if ttl is not None and status.completion_time is not None:
        ended = datetime.fromisoformat(status.completion_time.replace("Z", "+00:00"))
        if now - ended >= timedelta(seconds=ttl):
            log.info("%s: %s s after it finished: deleting it", ref.name, ttl)
            await ctx.kube.delete_job(ref.namespace, ref.name)


async def on_delete(ctx: Context, body: Body) -> None:
    """Before the job goes (the finalizer): its end in the database; the pods go with it (owned)."""
    status = _status(body)
    ctx.swept.discard(body["metadata"]["uid"])
    job = ctx.jobs.pop(body["metadata"]["uid"], None)
    if job is not None:
        await job.runtime.close()
    if status.record_id is not None and status.phase not in FINISHED:
        end_job(ctx.db, status.record_id, "deleted")
    log.info("%s: deleted", body["metadata"]["name"])
