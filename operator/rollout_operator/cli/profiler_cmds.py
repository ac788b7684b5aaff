"""`rolloutctl profile | db | simulate | bench planner` (filled in by the profiler issue)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the profiler, database and simulator commands to ``app``."""
    del app
