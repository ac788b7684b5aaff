"""Parsing of list-valued CLI flags, shared by the commands."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rollout_worker.config.engine_settings import FIELDS, flag_of
from rollout_worker.config.engine_shape import EngineShape
from rollout_worker.errors import UserError
from rollout_worker.server.settings import ServerSettings

F = TypeVar("F", bound=Callable[..., Any])
ENGINE_EXTRA = "pip install 'elastic-rollout[engine]'"


def require_engine() -> None:
    """The engine needs torch, which only the ``engine`` extra installs (the operator and the sidecar run
    without it): say so before anything starts, not as a rank's ImportError."""
    if importlib.util.find_spec("torch") is None:
        raise UserError(f"this command runs the engine, which needs torch: {ENGINE_EXTRA}")


def needs_engine(command: F) -> F:
    """A command that runs the engine (see ``require_engine``)."""

    @functools.wraps(command)
    def checked(*args: Any, **kwargs: Any) -> Any:
        require_engine()
        return command(*args, **kwargs)

    return checked  # type: ignore[return-value]


def int_list(text: str, flag: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, unique); errors name the flag."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise UserError(f"{flag}: {text!r} is not a comma-separated list of integers") from exc
    if not vals or min(vals) < 1:
        raise UserError(f"{flag}: values must be integers >= 1")
    return sorted(set(vals))


# Fields of the CLI's own inputs -> their flags, so library errors (which name fields) read as flags here.
# The engine's shape and settings and the server's settings map by rule (``engine_settings.flag_of``).
FLAG_OF_FIELD = {"prompts": "--prompts", "reconfigure": "--reconfigure"}


def as_flags(exc: UserError) -> UserError:
    """The error with its field named as this CLI's flag (``candidates[2]`` -> ``--candidates[2]``)."""
    return exc.renamed({**{f: flag_of(f) for f in SETTINGS_FIELDS}, **FLAG_OF_FIELD})


SETTINGS_FIELDS = frozenset(FIELDS) | frozenset(EngineShape.model_fields)
SETTINGS_FIELDS |= frozenset(ServerSettings.model_fields)


def bench_group(app: typer.Typer) -> typer.Typer:
    """The `bench` group: the one another command module registered already, else a new one."""
    for info in app.registered_groups:
        if info.name == "bench" and info.typer_instance is not None:
            return info.typer_instance
    bench = typer.Typer(help="Benchmarks (JSON output + printed tables).", no_args_is_help=True)
    app.add_typer(bench, name="bench")
    return bench
