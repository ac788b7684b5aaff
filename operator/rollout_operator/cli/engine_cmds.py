"""rolloutctl commands: engine_cmds (placeholder until its issue fills it)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    del app
