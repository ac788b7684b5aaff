"""Replies to the commands the ranks answer (a switch, a weight load, a memory release), by ticket.

The driver opens a ticket before it sends the command, the reader thread records each reply, and the
caller that sent it takes the replies once the expected number arrived. A ticket nobody waits for (a
plan's switch) is forgotten as soon as it is complete. Not thread-safe by itself: the driver calls it under
its lock and waits on its condition until :meth:`Tickets.complete` holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.engine.messages import Done

Reply = ReconfigEvent | Done  # a switch's outcome (from rank 0) | one rank's answer to another command


@dataclass(slots=True)
class _Ticket:
    expected: int
    awaited: bool
    replies: list[Reply] = field(default_factory=list)


class Tickets:
    def __init__(self) -> None:
        self._numbers = itertools.count(1)
        self._open: dict[int, _Ticket] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, expected: int, awaited: bool = True) -> int:
        """A new ticket that is complete after ``expected`` replies."""
        if expected < 1:
            raise ValueError(f"a ticket expects at least one reply, got {expected}")
        number = next(self._numbers)
        self._open[number] = _Ticket(expected, awaited)
        return number

    def reply(self, number: int, reply: Reply) -> None:
        """Record one reply (to a ticket already taken or forgotten: ignored)."""
        t = self._open.get(number)
        if t is None:
            return
        t.replies.append(reply)
        if not t.awaited and len(t.replies) >= t.expected:
            del self._open[number]

    def complete(self, number: int) -> bool:
        t = self._open.get(number)
        return t is not None and len(t.replies) >= t.expected

    def replies(self, number: int) -> list[Reply]:
        """The replies so far (the ticket stays open)."""
        t = self._open.get(number)
        return [] if t is None else list(t.replies)

    def take(self, number: int) -> list[Reply]:
        """Close the ticket; its replies so far (fewer than expected when the waiter gave up)."""
        t = self._open.pop(number, None)
        return [] if t is None else t.replies
