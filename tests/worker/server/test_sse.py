"""Server-sent events carry one JSON value per ``data:`` line, whatever its strings hold."""

from __future__ import annotations

import json

import httpx
from rollout_worker.server.routes.generate import sse_event


def test_an_event_is_one_line_for_every_line_splitter() -> None:
    value = {"text": "a\u2028b\u2029c\x85d\ne\rf\x0bg\x0ch\x1ci\x1dj\x1ek", "ids": [1]}
    event = sse_event(value)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    line = event.decode()[: -len("\n\n")]
    assert line.splitlines() == [line]  # str.splitlines cuts at every one of those characters
    assert list(httpx.Response(200, content=event).iter_lines()) == [line, ""]
    assert json.loads(line[len("data: ") :]) == value
