"""The plan and the switch in flight: which plans are accepted, when a plan's trigger starts a switch, and
what a switch's outcome changes.

At most one switch is in flight; it ends with the ranks' ``Switched`` report. A requested switch
(:meth:`Engine.reconfigure`) has a caller waiting for its ticket; a plan's switch has none. Not thread-safe
by itself: the driver calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.engine import messages as m
from rollout_worker.engine.driver.request_table import RequestTable
from rollout_worker.engine.driver.tickets import Tickets
from rollout_worker.errors import Conflict, UserError
from rollout_worker.scheduling.costs import Method
from rollout_worker.scheduling.layout import Layout


class Switching:
    def __init__(
        self,
        table: RequestTable,
        tickets: Tickets,
        broadcast: Callable[[m.Command], None],
        candidates: Sequence[Layout],
    ) -> None:
        self.table, self.tickets, self.broadcast, self.candidates = table, tickets, broadcast, candidates
        self.ticket: int | None = None  # the switch in flight

    @property
    def in_flight(self) -> bool:
        return self.ticket is not None

    def check_layout(self, layout: Layout, where: str) -> None:
        if layout not in self.candidates:
            raise UserError(
                f"{layout} is not among the candidate layouts ({', '.join(map(str, self.candidates))})",
                where,
            )

    def set_plan(self, plan: Plan | None) -> None:
        """Replace the plan. Refused (409) unless ``plan.based_on_layout`` is the current layout and no
        switch is in flight."""
        if plan is not None:
            if self.in_flight or plan.based_on_layout != self.table.layout:
                now = "switching" if self.in_flight else f"in {self.table.layout}"
                raise Conflict(
                    f"plan is based on {plan.based_on_layout}, but the engine is {now}", "based_on_layout"
                )
            for i, trig in enumerate(plan.triggers):
                self.check_layout(trig.layout, f"triggers[{i}].layout")
        self.table.set_plan(plan)

    def start(self, layout: Layout, method: Method, reason: str, awaited: bool = True) -> int:
        """Send every rank the switch; returns its ticket."""
        cmd = m.Reconfigure(layout, method, reason, self.tickets.open(1, awaited))
        self.began(cmd)
        self.broadcast(cmd)
        return cmd.ticket

    def began(self, cmd: m.Reconfigure) -> None:
        """``cmd`` (being sent to every rank) is the switch in flight."""
        self.ticket = cmd.ticket

    def fire(self) -> None:
        """Start the plan's switch when a trigger fires now (unless a switch is in flight)."""
        if self.in_flight:
            return
        trig = self.table.fire()
        if trig is not None:
            reason = f"plan: unfinished {self.table.unfinished} <= {trig.unfinished_at_most}"
            self.start(trig.layout, trig.method, reason, awaited=False)

    def on_switched(self, msg: m.Switched, time_s: float) -> ReconfigEvent:
        """The switch ended (committed or rolled back): record it and answer its ticket."""
        event = self.table.on_switched(msg, time_s)
        self.ticket = None
        self.tickets.reply(msg.ticket, event)
        return event
