"""`rolloutctl operator`: the Kubernetes operator (kopf) that runs RolloutJobs; settings from
``ROLLOUT_OPERATOR_*`` (`--list-settings`), credentials from the pod's service account or $KUBECONFIG."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("operator")(operator_cmd)


def operator_cmd(
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Watch this namespace (repeatable; none: the whole cluster)."),
    ] = None,
    list_settings: Annotated[
        bool, typer.Option("--list-settings", help="Print every ROLLOUT_OPERATOR_* setting and exit.")
    ] = False,
) -> None:
    """Run the operator: for each RolloutJob it makes a token Secret, a headless Service and the pods
    (engine server + sidecar), polls the sidecars, runs the planner and pushes its plans, writes the job's
    status and Events, and records jobs and decisions in the database. Stops on SIGTERM / Ctrl-C."""
    from rollout_operator.cluster.settings import describe, load_settings

    if list_settings:
        for name, default, doc in describe():
            typer.echo(f"{name:42} {default or '-':10} {doc}")
        return
    settings = load_settings()
    if namespace:
        settings = settings.model_copy(update={"namespaces": [*settings.namespaces, *namespace]})
    logging.getLogger().setLevel(settings.log_level)
    if settings.log_level != "DEBUG":  # kopf logs every timer run at INFO: one line per job per tick
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from rollout_operator.kube.main import run

    asyncio.run(run(settings))
