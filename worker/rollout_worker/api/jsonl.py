"""Reading JSON Lines input: every error names the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_worker.api.errors import UserError


def iter_jsonl(path: str | Path, what: str) -> Iterator[tuple[str, int, Any]]:
    """Yield ``("FILE:LINE", line number, parsed value)`` for every non-blank line of ``path``.

    ``what`` names the input (a field) in the not-found error (e.g. ``prompts``).
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError as exc:
        raise UserError(f"file not found: {path}", what) from exc
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path} as text ({type(exc).__name__})", what) from exc
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        yield where, n, obj
