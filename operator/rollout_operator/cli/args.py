"""Parsing of list-valued CLI flags, shared by the commands."""

from __future__ import annotations

from rollout_worker.api.errors import UserError


def int_list(text: str, flag: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, unique); errors name the flag."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise UserError(f"{flag}: {text!r} is not a comma-separated list of integers") from exc
    if not vals or min(vals) < 1:
        raise UserError(f"{flag}: values must be integers >= 1")
    return sorted(set(vals))
