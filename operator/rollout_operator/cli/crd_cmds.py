"""`rolloutctl crd`: the RolloutJob CustomResourceDefinition, generated from the job spec's pydantic model
(``crds/rolloutjob.yaml`` is its output; ``make crds`` rewrites it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("crd")(crd_cmd)


def crd_cmd(
    out: Annotated[Path | None, typer.Option(help="Write it here (default: standard output).")] = None,
    reference: Annotated[
        bool, typer.Option("--reference", help="Its field reference as Markdown instead (the docs' page).")
    ] = False,
) -> None:
    """Print the RolloutJob CRD (apiextensions.k8s.io/v1) as YAML, or its field reference."""
    from rollout_worker.data.files import check_writable, save

    if out is not None:
        check_writable(out, "--out")
    if reference:
        from rollout_operator.api.crd_reference import reference_markdown

        text = reference_markdown()
    else:
        from rollout_operator.api.crd_yaml import crd_yaml

        text = crd_yaml()
    if out is None:
        typer.echo(text, nl=False)
        return
    typer.echo(f"wrote {save(out, text, '--out')}")
