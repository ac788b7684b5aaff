"""The driver's record of the trainers' weight-update groups (torch-free: the driver runs in the server's
process): each group is being joined (every rank was asked) or joined (every rank answered that it joined).
The ranks' side, joining beside their step loops, is ``rollout_worker.engine.rank.weight_sync``."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_worker.engine.messages import JoinWeightGroup
from rollout_worker.errors import Conflict, UserError


@dataclass(frozen=True, slots=True)
class Joining:
    """A join under way, as ``/health`` shows it."""

    group_name: str
    master_address: str
    master_port: int
    timeout_s: float
    since: float  # time.monotonic() when it began


class GroupBook:
    """The driver's record of the trainers' groups: each is joining (every rank was asked) or joined (every
    rank answered that it joined). Not thread-safe by itself: the driver calls it under its lock; readers
    take :attr:`joining`, an immutable tuple, without it."""

    def __init__(self) -> None:
        self.joined: set[str] = set()
        self.joining: tuple[Joining, ...] = ()

    def begin(self, cmd: JoinWeightGroup, now: float) -> None:
        """Record a join (409 while the name is joined or joining)."""
        name = cmd.group_name
        if name in self.joined or any(j.group_name == name for j in self.joining):
            raise Conflict(f"weight update group {name!r} exists; destroy it first", "group_name")
        j = Joining(name, cmd.master_address, cmd.master_port, cmd.timeout_s, now)
        self.joining = (*self.joining, j)

    def end(self, name: str, joined: bool) -> None:
        """The join of ``name`` ended: joined, or given up."""
        self.joining = tuple(j for j in self.joining if j.group_name != name)
        if joined:
            self.joined.add(name)

    def forget(self, name: str) -> None:
        """Every rank left ``name``."""
        self.joined.discard(name)

    def check_joined(self, name: str) -> None:
        """Refuse a group that is not joined: unknown (400) or still joining (409)."""
        if any(j.group_name == name for j in self.joining):
            raise Conflict(f"weight update group {name!r} is still being joined", "group_name")
        if name not in self.joined:
            raise UserError(
                f"no weight update group {name!r}; call /init_weights_update_group first", "group_name"
            )
