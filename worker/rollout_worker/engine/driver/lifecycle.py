"""The engine's health: five states, the moves between them, and the failure that ended serving.

::

    starting -> ready | failed | stopping
    ready    -> failed | stopping
    failed   -> stopping | stopped
    stopping -> failed | stopped

``starting`` until every rank has loaded its weights; ``ready`` while serving; ``failed`` once a rank died
or the driver broke (the reason is kept); ``stopping`` while :meth:`Engine.shutdown` drains and stops the
ranks (a failure may still happen then); ``stopped`` at the end. Any other move is refused, so a late rank
report cannot turn a stopping or failed engine back into a ready one.

:class:`Status` is an immutable value: a reader in another thread (``/health``) sees one whole status,
never a health without its failure. :class:`Lifecycle` is not thread-safe by itself: the driver calls
:meth:`Lifecycle.move` under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rollout_worker.errors import Unavailable


class Health(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


_MOVES: dict[Health, frozenset[Health]] = {
    Health.STARTING: frozenset({Health.READY, Health.FAILED, Health.STOPPING}),
    Health.READY: frozenset({Health.FAILED, Health.STOPPING}),
    Health.FAILED: frozenset({Health.STOPPING, Health.STOPPED}),
    Health.STOPPING: frozenset({Health.FAILED, Health.STOPPED}),
    Health.STOPPED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class Status:
    health: Health = Health.STARTING
    failure: str | None = None  # why the engine failed (kept while it stops)

    @property
    def serving(self) -> bool:
        return self.health is Health.READY

    def check_serving(self) -> None:
        """Refuse (503) every verb but the read-only ones unless the engine serves."""
        if not self.serving:
            raise Unavailable(f"engine is {self.health}" + (f": {self.failure}" if self.failure else ""))


class Lifecycle:
    def __init__(self) -> None:
        self.status = Status()

    def move(self, to: Health, failure: str | None = None) -> bool:
        """Move to ``to`` if that move is allowed (see the module docstring); returns whether it moved.
        ``failure`` is recorded with a move to ``failed``; the failure stays through the later moves."""
        now = self.status
        if to not in _MOVES[now.health]:
            return False
        self.status = Status(to, failure if to is Health.FAILED else now.failure)
        return True
