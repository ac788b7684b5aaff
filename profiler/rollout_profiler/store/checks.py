"""Checks shared by the repository functions."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from rollout_worker.errors import UserError
from sqlalchemy import FromClause
from sqlalchemy.sql.sqltypes import String

from rollout_profiler.store.models import utcnow


def check_lengths(table: FromClause, values: Mapping[str, Any], where: str) -> None:
    """Refuse strings longer than their column (SQLite would store them, PostgreSQL would fail)."""
    for col in table.columns:
        value = values.get(col.name)
        limit = col.type.length if isinstance(col.type, String) else None
        if limit and isinstance(value, str) and len(value) > limit:
            raise UserError(f"{where}: {col.name} is longer than {limit} characters")


def aware(value: datetime | None, what: str) -> datetime:
    """``value`` (now when None), refusing naive datetimes."""
    if value is None:
        return utcnow()
    if value.tzinfo is None:
        raise ValueError(f"{what} must be timezone-aware, got naive {value!r}")
    return value
