"""Settings read from the environment under a prefix (the sidecar's ``ROLLOUT_SIDECAR_*``, the operator's
``ROLLOUT_OPERATOR_*``): one way to refuse a misspelt variable and one way to list them for ``--help``."""

from __future__ import annotations

import os

from pydantic import BaseModel

from rollout_worker.api.errors import UserError


def refuse_unknown(prefix: str, fields: type[BaseModel], command: str) -> None:
    """An unknown ``PREFIX*`` variable (a typo) is an error naming it, not a setting silently ignored."""
    known = {prefix + f.upper() for f in fields.model_fields}
    for var in sorted(os.environ):
        if var.upper().startswith(prefix) and var.upper() not in known:
            raise UserError(f"unknown setting (see `{command} --list-settings`)", var)


def describe(prefix: str, fields: type[BaseModel]) -> list[tuple[str, str, str]]:
    """(variable, default, description) of every setting."""
    out = []
    for name, info in fields.model_fields.items():
        default = "[]" if info.default_factory is not None else ("" if info.default is None else info.default)
        out.append((prefix + name.upper(), str(default), info.description or ""))
    return out
