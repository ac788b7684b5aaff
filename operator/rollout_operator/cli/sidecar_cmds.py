"""`rolloutctl sidecar`: a pod's sidecar (job or service mode), every setting from ``ROLLOUT_SIDECAR_*``."""

from __future__ import annotations

import sys
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("sidecar")(sidecar_cmd)


def sidecar_cmd(
    list_settings: Annotated[
        bool, typer.Option("--list-settings", help="Print every ROLLOUT_SIDECAR_* setting and exit.")
    ] = False,
) -> None:
    """Run a pod's sidecar beside its engine server: in job mode it sends the pod's shard of the prompts to
    the engine and writes every sample once (resuming from its output file); in both modes it serves
    progress, the engine's state and the samples on its API port, and forwards plans on its admin port.
    Settings come from the environment (`--list-settings`). Stops cleanly on SIGTERM / Ctrl-C (exit 0);
    exits 1 when the engine stays unreachable."""
    from rollout_worker.sidecar.settings import describe, load_settings

    if list_settings:
        for name, default, doc in describe():
            typer.echo(f"{name:40} {default or '-':24} {doc}")
        return
    from rollout_worker.errors import UserError
    from rollout_worker.sidecar.run import run
    from rollout_worker.sidecar.settings import SidecarFields, env_name

    try:
        code = run(load_settings())
    except UserError as exc:  # errors name settings fields; here they are environment variables
        raise exc.renamed({f: env_name(f) for f in SidecarFields.model_fields}) from None
    sys.exit(code)
