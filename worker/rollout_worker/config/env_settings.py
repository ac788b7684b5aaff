"""Settings read from the environment under a prefix (the sidecar's ``ROLLOUT_SIDECAR_*``, the operator's
``ROLLOUT_OPERATOR_*``): one way to refuse a misspelt variable and one way to list them for ``--help``."""

from __future__ import annotations

import os
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, SettingsError

from rollout_worker.errors import UserError, user_error

S = TypeVar("S", bound=BaseSettings)


def env_name(prefix: str, field: str) -> str:
    """A setting's variable: ``("ROLLOUT_SIDECAR_", "pod_index")`` -> ``ROLLOUT_SIDECAR_POD_INDEX``."""
    return prefix + field.upper()


def load(settings: type[S], prefix: str, command: str) -> S:
    """The settings from the environment; errors name the variable (``ROLLOUT_SIDECAR_POD_INDEX: ...``). An
    unknown ``PREFIX*`` variable (a typo) is refused, not ignored."""
    refuse_unknown(prefix, settings, command)
    try:
        return settings()
    except ValidationError as exc:
        raise user_error(exc, lambda path: env_name(prefix, str(path[0]))) from None
    except SettingsError as exc:  # a list or a mapping whose value is not JSON
        found = re.search(r'field "(\w+)"', str(exc))
        field = env_name(prefix, found.group(1)) if found else None
        raise UserError('not valid JSON (a list is written ["a", "b"])', field) from None


def refuse_unknown(prefix: str, fields: type[BaseModel], command: str) -> None:
    """An unknown ``PREFIX*`` variable (a typo) is an error naming it, not a setting silently ignored."""
    known = {env_name(prefix, f) for f in fields.model_fields}
    for var in sorted(os.environ):
        if var.upper().startswith(prefix) and var.upper() not in known:
            raise UserError(f"unknown setting (see `{command} --list-settings`)", var)


def describe(prefix: str, fields: type[BaseModel]) -> list[tuple[str, str, str]]:
    """(variable, default, description) of every setting."""
    out = []
    for name, info in fields.model_fields.items():
        default = "[]" if info.default_factory is not None else ("" if info.default is None else info.default)
        out.append((env_name(prefix, name), str(default), info.description or ""))
    return out
