"""Options derived from settings models: a field added to ``EngineSettings``
(:mod:`rollout_worker.config.engine_settings`), to ``EngineShape`` or to the server's ``ServerSettings`` is a
flag of `rolloutctl serve` and `rolloutctl generate` (and, for serve, a ``ROLLOUT_SERVE_<NAME>`` variable)
here with no further code.

:func:`with_model_options` adds one typer option per field of a model to a command and hands the command
the validated model; :func:`structural_options` does the same for the engine's shape (model, ranks,
layouts, dtype). The commands that take a few engine settings on their own (simulate, the benchmarks,
profile) spell them with :func:`setting_option` and :func:`setting_default`: the field's flag, help and
default, but for the defaults written once in :data:`DEFAULT_OVERRIDES`.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, cast

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from rollout_worker.config.engine_settings import DEFAULTS, EngineSettings, env_of, flag_of, parse_settings
from rollout_worker.config.engine_shape import EngineShape, parse_shape

F = TypeVar("F", bound=Callable[..., Any])


def _option(name: str, info: FieldInfo, envvar: bool) -> tuple[Any, Any]:
    """(annotation, default) of the typer parameter for one settings field."""
    default = ... if info.is_required() else info.get_default(call_default_factory=True)
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


def structural_options(envvar: bool) -> Callable[[F], F]:
    """One option per field of the engine's shape; the command gets the validated ``EngineShape`` as
    ``shape`` (``envvar``: each also read from ``ROLLOUT_SERVE_<NAME>``)."""
    return with_model_options(EngineShape, "shape", envvar, parse=parse_shape)


# The one place a command defaults an engine setting otherwise than EngineSettings does: each as the command
# had it before its options were derived from the model (every other option named for a setting takes the
# model's default; tests/worker/config/test_one_spelling.py holds them to it).
DEFAULT_OVERRIDES: dict[str, dict[str, Any]] = {
    "bench simulator": {"page_size": 4, "max_batch": 16},  # a pool tight enough to retract
    "simulate": {"max_batch": 0},  # 0: no limit but KV memory's
    "bench lossless": {"deterministic": True},  # also run the deterministic kernels (a bench's choice)
}


def setting_default(command: str, name: str) -> Any:
    """``command``'s default for engine setting ``name``: its override, else the model's."""
    return DEFAULT_OVERRIDES.get(command, {}).get(name, getattr(DEFAULTS, name))


def setting_option(name: str, note: str = "", help: str | None = None, mode: bool = False) -> Any:
    """The typer option of engine setting ``name``: its flag (``--x/--no-x`` for a boolean, unless the
    command takes it as a ``mode`` string), and its field's description (``note`` added) as help unless
    ``help`` says what the command does with it. Its bounds are checked by ``check_setting``."""
    info = EngineSettings.model_fields[name]
    text = info.description or ""
    if note:
        text = f"{text.rstrip('.')}; {note}."
    decl = flag_of(name)
    if info.annotation is bool and not mode:
        decl += "/--no-" + name.replace("_", "-")
    return typer.Option(decl, help=help if help is not None else text)
