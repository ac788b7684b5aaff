"""Reading JSON Lines input: every error names the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_worker.data.files import MAX_DATA_BYTES, read_text
from rollout_worker.errors import UserError


def iter_jsonl(path: str | Path, what: str) -> Iterator[tuple[str, int, Any]]:
    """Yield ``("FILE:LINE", line number, parsed value)`` for every non-blank line of ``path``.

    ``what`` names the input (a field) in the not-found error (e.g. ``prompts``).
    """
    text = read_text(path, what, limit=MAX_DATA_BYTES)
    # Lines end at "\n" only (JSON Lines): str.splitlines would also cut at U+2028, U+0085 and other
    # characters a JSON string may hold unescaped. A "\r" before the "\n" is JSON whitespace.
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        yield where, n, obj


def read_strings(path: str | Path, what: str) -> list[str]:
    """Every line of ``path`` a JSON string (SGLang's corpus files); an error names the file and line."""
    out = []
    for where, _, obj in iter_jsonl(path, what):
        if not isinstance(obj, str):
            raise UserError(f"{where}: expected a JSON string, got {type(obj).__name__}", what)
        out.append(obj)
    if not out:
        raise UserError(f"{path}: no document in it", what)
    return out
