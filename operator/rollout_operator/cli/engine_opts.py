"""Options of `rolloutctl serve` and `rolloutctl generate` derived from settings models: a field added to
``EngineSettings`` (:mod:`rollout_worker.config.engine_settings`) or to the server's ``ServerSettings`` is a
flag (and, for serve, a ``ROLLOUT_SERVE_<NAME>`` variable) here with no further code.

:func:`with_model_options` adds one typer option per field of a model to a command and hands the command
the validated model; :func:`structural_options` does the same for what every engine command also needs
(model, ranks, layouts, dtype).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from rollout_worker.config.engine_settings import (
    DTYPES,
    Dtype,
    EngineSettings,
    env_of,
    flag_of,
    parse_settings,
)

F = TypeVar("F", bound=Callable[..., Any])


def _option(name: str, info: FieldInfo, envvar: bool) -> tuple[Any, Any]:
    """(annotation, default) of the typer parameter for one settings field."""
    default = info.get_default(call_default_factory=True)
    env = env_of(name) if envvar else None
    help_ = info.description or ""
    ann = info.annotation
    decl = f"{flag_of(name)}/--no-{name.replace('_', '-')}" if ann is bool else flag_of(name)
    return Annotated[ann, typer.Option(decl, help=help_, envvar=env)], default


def _extend(command: Callable[..., Any], extra: dict[str, tuple[Any, Any]], wrapper: F, drop: str) -> F:
    """``wrapper`` with ``command``'s signature, less ``drop``, plus the keyword parameters ``extra``."""
    hints = typing.get_type_hints(command, include_extras=True)
    params = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(command).parameters.values()
        if p.name != drop
    ]
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d)
        for n, (a, d) in extra.items()
    ]
    wrapper.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def with_model_options(
    model: type[BaseModel],
    param: str,
    envvar: bool,
    exclude: tuple[str, ...] = (),
    parse: Callable[[dict[str, Any]], Any] | None = None,
) -> Callable[[F], F]:
    """One option per field of ``model`` (but ``exclude``), handed to the command as ``param``: the values
    parsed by ``parse`` (default: the dict itself). ``envvar``: each also read from ROLLOUT_SERVE_<NAME>."""
    fields = [n for n in model.model_fields if n not in exclude]
    extra = {n: _option(n, model.model_fields[n], envvar) for n in fields}

    def deco(command: F) -> F:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in fields}
            return command(*args, **{param: parse(values) if parse else values}, **kwargs)

        return _extend(command, extra, cast(F, run), drop=param)

    return deco


def with_engine_settings(envvar: bool) -> Callable[[F], F]:
    """One option per engine setting; the command gets the validated ``EngineSettings`` as ``engine``."""
    return with_model_options(EngineSettings, "engine", envvar, parse=parse_settings)


STRUCTURE_HELP = {
    "model": "Checkpoint directory (config.json, safetensors, tokenizer.json).",
    "ranks": "Rank processes G (GPUs on a GPU machine).",
    "layout": "Initial layout DxT with D*T = G (default Gx1).",
    "candidates": "Layouts the engine may switch to, e.g. 4x1,2x2,1x4 (default: every one that fits).",
    "dtype": "The weights' dtype: " + " | ".join(DTYPES) + ".",
}


def structural_options(envvar: bool) -> Callable[[F], F]:
    """The model, ranks, layouts and dtype of an engine command, handed over as ``structure``: a dict
    with those keys (``envvar``: each also read from ``ROLLOUT_SERVE_<NAME>``)."""

    def opt(name: str) -> Any:
        return typer.Option(flag_of(name), help=STRUCTURE_HELP[name], envvar=env_of(name) if envvar else None)

    extra: dict[str, tuple[Any, Any]] = {
        "model": (Annotated[Path, opt("model")], ...),
        "ranks": (Annotated[int, opt("ranks")], 1),
        "layout": (Annotated[str | None, opt("layout")], None),
        "candidates": (Annotated[str | None, opt("candidates")], None),
        "dtype": (Annotated[Dtype, opt("dtype")], "float32"),
    }

    def deco(command: F) -> F:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            structure = {name: kwargs.pop(name) for name in extra}
            return command(*args, structure=structure, **kwargs)

        return _extend(command, extra, cast(F, run), drop="structure")

    return deco
