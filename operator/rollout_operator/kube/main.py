"""The kopf side of the operator: decorators only, each delegating to ``handlers``; and ``run``, which
starts kopf with the settings (watched namespaces, peering, liveness) on a registry of its own."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, cast

import kopf

from rollout_operator.api import cluster as k
from rollout_operator.cluster.reconcile import Event
from rollout_operator.cluster.settings import OperatorSettings
from rollout_operator.kube import handlers
from rollout_operator.kube.client import Kube, connect
from rollout_operator.kube.metrics import OperatorMetrics

log = logging.getLogger(__name__)
RESOURCE = (k.GROUP, k.VERSION, k.PLURAL)


def _post(body: dict[str, Any], ev: Event) -> None:
    kopf.event(cast(kopf.Body, body), type=ev.type, reason=ev.reason, message=ev.message)


def _open_db(settings: OperatorSettings) -> Any:
    from rollout_profiler.store import database, migrate

    given = settings.database_url.get_secret_value() if settings.database_url is not None else None
    url = database.resolve_url(given)
    migrate.upgrade(url)
    return database.make_engine(url)


def registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    ops = settings
    reg = kopf.OperatorRegistry()
    state: dict[str, handlers.Context] = {}

    @kopf.on.login(registry=reg)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        """The pod's service account in a cluster, else $KUBECONFIG (kopf's own readers, no client)."""
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=reg)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        # kopf's own bookkeeping in annotations under our group: the status is ours alone
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=k.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=k.GROUP)
        settings.persistence.finalizer = k.FINALIZER
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 270  # re-list before an API server's watch cache expires (410)
        metrics = OperatorMetrics()
        metrics.serve(ops.metrics_port)
        db = await asyncio.to_thread(_open_db, ops)
        state["ctx"] = handlers.Context(ops, Kube(await connect()), db, metrics, _post)

    @kopf.on.cleanup(registry=reg)
    async def cleanup(**_: Any) -> None:
        ctx = state.pop("ctx", None)
        if ctx is not None:
            for job in ctx.jobs.values():
                await job.runtime.close()
            await ctx.kube.close()
            ctx.db.dispose()

    @kopf.on.create(*RESOURCE, registry=reg)
    async def created(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        patch.status.update(await handlers.on_create(state["ctx"], dict(body)))

    @kopf.timer(*RESOURCE, interval=ops.tick_seconds, registry=reg)
    async def tick(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        ctx = state["ctx"]
        t0 = time.perf_counter()
        try:
            new = await handlers.on_tick(ctx, dict(body))
        except Exception:
            ctx.metrics.tick_errors.inc()
            raise
        finally:
            ctx.metrics.ticks.observe(time.perf_counter() - t0)
        if new is not None:
            patch.status.update(new)

    @kopf.on.delete(*RESOURCE, registry=reg)
    async def deleted(body: kopf.Body, **_: Any) -> None:
        await handlers.on_delete(state["ctx"], dict(body))

    return reg


def _priority(settings: OperatorSettings) -> int:
    """Replicas of one Deployment share their settings: a priority drawn per process tells them apart
    (kopf lets operators of equal priority all act)."""
    if settings.priority is not None:
        return settings.priority
    return secrets.randbelow(2**30) + 1 if settings.peering is not None else 0


async def run(settings: OperatorSettings, stop: asyncio.Event | None = None) -> None:
    """Run the operator until SIGTERM / SIGINT (or ``stop``)."""
    namespaces = list(settings.namespaces)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    await kopf.operator(
        registry=registry(settings),
        clusterwide=not namespaces,
        namespaces=namespaces,
        peering_name=settings.peering,
        standalone=settings.peering is None,
        priority=_priority(settings),
        liveness_endpoint=liveness,
        stop_flag=stop,
    )
