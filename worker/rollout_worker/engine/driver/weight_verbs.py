"""The driver's weight verbs: a weight load between steps (from a checkpoint or a trainer's broadcast), the
weights' version, and joining or leaving a trainer's weight-update group.

A load holds new requests in the driver, waits until the requests in flight finished (or are paused), and
runs as one command every rank answers, under the driver's global lock. A join takes neither lock while it
waits: the ranks join beside their step loops, and generation goes on.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_worker.engine import messages as m
from rollout_worker.engine.driver.shared import Shared, dones
from rollout_worker.errors import EngineError, UserError


class WeightVerbs:
    def __init__(self, shared: Shared, abort_all: Callable[[str], object]) -> None:
        self.shared = shared
        self.abort_all = abort_all  # aborts every request, with that message

    def load(
        self,
        make: Callable[[int], m.LoadWeights | m.ReceiveWeights],
        version: str | None,
        abort_all: bool,
        timeout_s: float,
        field: str,
        group: str | None = None,
    ) -> int:
        """Run a weight load (``make``) between steps; ``group``: the trainer's group it receives from,
        checked joined under the global lock (no leave between the check and the receive). Returns how
        many requests waited."""
        shared = self.shared
        with shared.one_at_a_time:
            with shared.lock:
                shared.check_serving()
                if group is not None:
                    shared.groups.check_joined(group)
                shared.flags.hold = True
            try:
                if abort_all:
                    self.abort_all("aborted for a weight update")
                waited = 0

                def idle() -> None:  # paused requests keep their place (see Engine.update_weights)
                    nonlocal waited
                    if not shared.changed.wait_for(
                        lambda: shared.table.dispatched == 0 or shared.flags.paused is not None, timeout_s
                    ):
                        raise EngineError(
                            f"requests still in flight after {timeout_s:.0f} s; weights not updated"
                        )
                    waited = shared.table.unfinished

                ticket, _ = shared.send(make, 1, idle)
                (done,) = dones(shared.await_(ticket, None))
                if not done.ok:
                    raise UserError(f"weights not updated: {done.message}", field)
                with shared.lock:
                    flags = shared.flags
                    flags.weight_version = flags.weight_version if version is None else version
                    flags.weight_loads += 1
                return waited
            finally:
                with shared.lock:
                    shared.flags.hold = False
                    shared.dispatch()

    def set_version(self, version: str, abort_all: bool = False) -> None:
        if abort_all:
            self.abort_all("aborted for a weight version update")
        with self.shared.lock:
            self.shared.check_serving()
            self.shared.flags.weight_version = version

    def check_group(self, name: str) -> None:
        with self.shared.lock:
            self.shared.groups.check_joined(name)

    def join_group(self, join: Callable[[int], m.JoinWeightGroup]) -> None:
        shared, world = self.shared, self.shared.cfg.world
        ticket, cmd = shared.send(join, world, accept=lambda cmd: shared.groups.begin(cmd, shared.now()))
        name, where = cmd.group_name, f"{cmd.master_address}:{cmd.master_port}"
        try:
            replies, _ = shared.gather(ticket, cmd.timeout_s, lambda rs: any(not d.ok for d in dones(rs)))
        except BaseException:
            self._give_up(name)
            raise
        joined = dones(replies)
        failed = [d.message for d in joined if not d.ok]
        if not failed and len(joined) == world:
            with shared.lock:
                shared.groups.end(name, joined=True)
            return
        self._give_up(name)
        if failed:
            why = f"could not join the trainer's rendezvous at {where}: {failed[0]}"
        else:
            missing = sorted(set(range(world)) - {d.rank for d in joined})
            why = (
                f"no trainer's rendezvous answered at {where} within {cmd.timeout_s:g} s "
                f"(rank(s) {', '.join(map(str, missing))} still waiting)"
            )
        raise UserError(f"weight update group {name!r} not joined: {why}", "master_address")

    def _give_up(self, name: str) -> None:
        """Every rank leaves ``name`` (a join under way is dropped when it ends); nobody waits for it."""
        shared = self.shared
        with shared.lock:
            shared.groups.end(name, joined=False)
            if shared.life.status.serving:
                shared.procs.broadcast(m.LeaveWeightGroup(name, shared.tickets.open(shared.cfg.world, False)))

    def leave_group(self, name: str) -> None:
        shared = self.shared
        with shared.one_at_a_time:
            self.check_group(name)
            shared.on_every_rank(lambda ticket: m.LeaveWeightGroup(name, ticket), None)
            with shared.lock:
                shared.groups.forget(name)
