"""Errors that reach the user as one clear line (the CLI prints them and exits non-zero)."""


class UserError(Exception):
    """Bad input from a user: a flag, a file, a line, a checkpoint. The message names the culprit."""


class EngineError(RuntimeError):
    """The engine failed while running (a rank died, a collective timed out, ...)."""


class ReconfigurationFailed(RuntimeError):
    """A reconfiguration could not complete on every rank; the engine rolled back to its previous layout."""
