"""Entry point of `rolloutctl`.

Each command module exposes ``register(app)``; heavy imports (torch, SQLAlchemy) happen inside the
commands so that ``rolloutctl --help`` stays fast.

Help is click's plain layout (``rich_markup_mode=None``, which every command and group added to ``app``
inherits): flag names on the left, whole, and their help wrapped beside or under them, at 80 columns and
when output is not a terminal (rich's option table splits 80 columns among five and cuts long flag names
to ``--max-prefill-t…``). Usage errors take click's plain form with it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback

import typer
from rollout_worker.errors import EngineError, UserError

from rollout_operator.cli.args import ENGINE_EXTRA, as_flags

app = typer.Typer(
    name="rolloutctl",
    help="elastic-rollout: adaptive tensor parallelism for RL rollouts.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: see the module's docstring
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register_all() -> None:
    from rollout_operator.cli import (
        crd_cmds,
        db_cmds,
        engine_cmds,
        memory_cmds,
        operator_cmds,
        profile_cmds,
        run_cmds,
        serve_cmds,
        sidecar_cmds,
        sim_cmds,
    )

    for module in (
        engine_cmds,
        memory_cmds,
        serve_cmds,
        sidecar_cmds,
        run_cmds,
        profile_cmds,
        db_cmds,
        sim_cmds,
        crd_cmds,
        operator_cmds,
    ):
        module.register(app)


_register_all()


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (how Kubernetes and most supervisors stop a process) unwinds like Ctrl-C: every command
    then stops its child processes on the way out."""
    raise KeyboardInterrupt


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:  # the terminal gets INFO and up, whatever a log file takes
        handler.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call is noise here
    logging.getLogger("alembic").setLevel(logging.WARNING)  # every plugin and context at INFO otherwise
    signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    except UserError as exc:
        typer.echo(f"error: {as_flags(exc)}", err=True)
        sys.exit(2)
    except EngineError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug: one line here, the traceback in a file (ROLLOUT_DEBUG=1: raised)
        if os.environ.get("ROLLOUT_DEBUG"):
            raise
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":  # an install without the extra
            typer.echo(f"error: this needs torch: {ENGINE_EXTRA}", err=True)
            sys.exit(2)
        typer.echo(f"error: internal error ({type(exc).__name__}: {exc}); {_crash_report()}", err=True)
        sys.exit(1)


def _crash_report() -> str:
    try:
        fd, path = tempfile.mkstemp(prefix="rolloutctl-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            traceback.print_exc(file=f)
    except OSError:
        return "set ROLLOUT_DEBUG=1 to see the traceback"
    return f"the traceback is in {path}; please report it"


if __name__ == "__main__":
    main()
