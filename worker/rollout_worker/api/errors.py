"""Errors that reach a user as one clear line: the CLI prints them, the HTTP server answers them as JSON.

Library code names the *field* a bad value came from (``layout``, ``sampling_params.top_p``), never a CLI
flag: the same message must make sense from ``rolloutctl``, an HTTP body or a custom resource's status.
The CLI maps fields to its flags (:func:`UserError.with_field`).
"""

from __future__ import annotations


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
