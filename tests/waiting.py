"""The one way a test waits for something another process or thread does: poll a predicate until it holds.

A wait is for a positive signal (a state, a counter, a log line, an event), never a fixed sleep; a test that
must show something does *not* happen waits for a later signal by which it would have happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T | None],
    *,
    what: str,
    timeout: float = 30.0,
    interval: float = 0.05,
    explain: Callable[[], str] | None = None,
) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy, and return that value.

    After ``timeout`` s, fail (AssertionError) naming ``what`` was awaited, the last value ``predicate``
    returned and, when given, ``explain()`` (logs, a status: whatever tells why). An exception raised by
    ``predicate`` is not caught: it fails the wait at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            why = "" if explain is None else f"\n{explain()}"
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}{why}"
            )
        time.sleep(interval)
