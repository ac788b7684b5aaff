"""The tests' one polling helper: returns what the predicate returned, fails saying what it waited for."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.waiting import wait_until


def test_returns_the_first_truthy_value_and_polls_until_then() -> None:
    seen: Iterator[Any] = iter([None, 0, [], {"phase": "Running"}, "never reached"])
    assert wait_until(lambda: next(seen), what="a phase", interval=0) == {"phase": "Running"}
    assert next(seen) == "never reached"


def test_a_timeout_names_what_was_awaited_the_last_value_and_the_explanation() -> None:
    values = iter(range(100))
    with pytest.raises(AssertionError) as err:
        wait_until(lambda: next(values) < 0, what="a negative", timeout=0, explain=lambda: "logs: none")
    assert str(err.value) == "timed out after 0 s waiting for a negative; last seen: False\nlogs: none"


def test_an_exception_in_the_predicate_fails_at_once() -> None:
    calls: list[int] = []

    def broken() -> bool:
        calls.append(1)
        raise RuntimeError("the operator exited")

    with pytest.raises(RuntimeError, match="the operator exited"):
        wait_until(broken, what="never", timeout=60)
    assert calls == [1]
