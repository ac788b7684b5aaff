"""A switch that no pushed decision matches (a later trigger of a pushed chain, or one nobody here asked
for): what is known of it, as the database's decision rows and the job's status both record it. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_worker.api.plan import ReconfigEvent


@dataclass(frozen=True)
class UnaskedSwitch:
    from_layout: str
    to_layout: str
    method: str
    reason: str
    predicted_gain_ms: float  # nobody predicted a gain: 0
    predicted_cost_ms: float  # the engine's own estimate
    running_requests: int


def unasked_switch(ev: ReconfigEvent) -> UnaskedSwitch:
    return UnaskedSwitch(
        from_layout=str(ev.src),
        to_layout=str(ev.dst),
        method=ev.method,
        reason=ev.reason,
        predicted_gain_ms=0.0,
        predicted_cost_ms=ev.predicted_ms,
        running_requests=ev.requests_running + ev.requests_waiting,
    )
