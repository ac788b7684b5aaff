"""Keys a client may send that this engine does not implement: accepted at their neutral value, refused
(naming the key) at any other. One home for that rule, for SGLang's ``/generate`` and OpenAI's routes.

SGLang's own keys come from ``sglang_surface.json`` (made by ``.ci/sglang_surface.py`` from an sglang
wheel; the version is in the file): every top-level key of ``GenerateReqInput``, every API key of
``SamplingParams``, and the keys sglang-router adds. A key's neutral values are its SGLang default, ``null``
(SGLang reads ``null`` as "use the default") and, for a key whose default is ``null``, an empty list or map.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from functools import cache
from importlib.resources import files
from typing import Any

from rollout_worker.errors import FieldAt

Neutral = Mapping[str, tuple[Any, ...]]


@cache
def sglang_surface() -> dict[str, Any]:
    """The data file: ``sglang_version``, ``generate``, ``sampling``, ``router`` (key -> type, default)."""
    data: dict[str, Any] = json.loads(files("rollout_worker.api").joinpath("sglang_surface.json").read_text())
    return data


def sglang_keys(section: str) -> dict[str, Any]:
    """Key -> SGLang's default for ``section`` ("generate": with the router's keys; "sampling")."""
    s = sglang_surface()
    keys = {**s[section], **(s["router"] if section == "generate" else {})}
    return {k: v["default"] for k, v in keys.items()}


def neutral_values(default: Any) -> tuple[Any, ...]:
    return (default, None, [], {}) if default is None else (default, None)


def sglang_neutral(
    section: str, implemented: Collection[str], also: Neutral | None = None
) -> dict[str, tuple[Any, ...]]:
    """The keys of ``section`` this engine does not implement, each with its neutral values (plus ``also``:
    values that change nothing here, such as ``log_metrics: false``)."""
    extra = also or {}
    return {
        k: neutral_values(d) + extra.get(k, ())
        for k, d in sglang_keys(section).items()
        if k not in implemented
    }


def same(a: Any, b: Any) -> bool:
    """JSON equality: ``false`` is not ``0``, ``1`` is ``1.0``."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def strip_neutral(data: Any, neutral: Neutral) -> Any:
    """``data`` (a body, before validation) without the keys of ``neutral``; a FieldAt naming the first one
    whose value is not neutral."""
    if not isinstance(data, dict):
        return data
    for key, value in data.items():
        ok = neutral.get(key)
        if ok is not None and not any(same(value, v) for v in ok):
            shown = " or ".join(json.dumps(v) for v in ok if v not in ([], {}))
            raise FieldAt((key,), f"{json.dumps(value)[:80]} is not supported by this engine (only {shown})")
    return {k: v for k, v in data.items() if k not in neutral}


def drop_nulls(data: Any) -> Any:
    """``data`` without its ``null`` values: SGLang reads a ``null`` as the key's default."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if v is not None}
