"""Errors that reach a user as one clear line: the CLI prints them, the HTTP server answers them as JSON.

Library code names the *field* a bad value came from (``layout``, ``sampling_params.top_p``), never a CLI
flag: the same message must make sense from ``rolloutctl``, an HTTP body or a custom resource's status.
The CLI maps fields to its flags, the settings to their environment variables (:meth:`UserError.renamed`).

A pydantic ``ValidationError`` (or FastAPI's ``RequestValidationError``) becomes field-named messages
here, once, for every surface (:func:`field_errors`, :func:`user_error`): a manifest (``job.yaml:14:
spec.parallelism.candidates[2]``), the environment (``ROLLOUT_SIDECAR_POD_INDEX``) and HTTP bodies
(``triggers.0.layout``) differ only in how they write the field's path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

FieldPath = tuple[str | int, ...]


class Invalid(Protocol):
    """What failed a validation: pydantic's ValidationError, FastAPI's RequestValidationError."""

    def errors(self) -> Sequence[Any]: ...


class UserError(Exception):
    """Bad input from a user: a field, a file, a line, a checkpoint. ``field`` names the culprit."""

    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def with_field(self, field: str) -> UserError:
        """The same error attributed to another name (e.g. the CLI flag that set the field)."""
        return type(self)(self.message, field)

    def renamed(self, names: Mapping[str, str]) -> UserError:
        """The same error with its field called as ``names`` calls it (fields -> flags or variables), an
        index kept (``candidates[2]`` -> ``--candidates[2]``); itself when ``names`` has no entry for it."""
        if self.field is None:
            return self
        base, sep, rest = self.field.partition("[")
        name = names.get(base)
        return self.with_field(name + sep + rest) if name else self


class Conflict(UserError):
    """The request contradicts the engine's current state (e.g. a plan based on a layout that changed)."""

    status = 409


class Forbidden(UserError):
    """Refused by policy (e.g. a weights path outside the allowed root)."""

    status = 403


class Unavailable(UserError):
    """The engine cannot take this now (starting, failed, shutting down, memory released)."""

    status = 503


class EngineError(RuntimeError):
    """The engine failed while running (a rank died, a collective timed out, ...)."""


class ReconfigurationFailed(RuntimeError):
    """A reconfiguration could not complete on every rank; the engine rolled back to its previous layout."""


class FieldAt(ValueError):
    """Raised in a model validator: a cross-field rule broken, attributed to the field at ``path`` (relative
    to the model), so that the error names that field rather than the model."""

    def __init__(self, path: FieldPath, message: str) -> None:
        super().__init__(message)
        self.path = path


def field_errors(
    exc: Invalid, limit: int | None = None, skip: Collection[str] = ()
) -> list[tuple[FieldPath, str]]:
    """Each error of a validation (the first ``limit``) as (the field's path, the message): a
    :class:`FieldAt` at the field it names, pydantic's own parts of a location (``function-after[...]``,
    and ``skip``: tags of union members) left out, its ``Value error, `` prefix dropped."""
    return [(_path(err, skip), _message(err)) for err in exc.errors()[:limit]]


def user_error(exc: Invalid, name: Callable[[FieldPath], str], skip: Collection[str] = ()) -> UserError:
    """The first error of a validation as a UserError, its field named ``name(path)`` (a variable, a flag);
    ``skip`` as :func:`field_errors`."""
    ((path, message),) = field_errors(exc, 1, skip)
    return UserError(message, name(path) if path else None)


def _path(err: Any, skip: Collection[str]) -> FieldPath:
    loc = tuple(
        x for x in err.get("loc", ()) if not (isinstance(x, str) and (x.startswith("function-") or x in skip))
    )
    cause = (err.get("ctx") or {}).get("error")
    return (*loc, *cause.path) if isinstance(cause, FieldAt) else loc


def _message(err: Any) -> str:
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")
