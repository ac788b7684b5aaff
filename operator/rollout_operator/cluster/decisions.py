"""What the planner loop did this tick, into the job's status: pushed plans and the switches that ran, each
a DecisionRecord (the last few kept; the database keeps all) and an Event. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

from rollout_worker.api.plan import ReconfigEvent

from rollout_operator.api.status import LAST_DECISIONS, DecisionRecord, RolloutJobStatus
from rollout_operator.cluster.reconcile import Event, iso
from rollout_operator.control.planner_loop import Outcome
from rollout_operator.control.switches import unasked_switch


@dataclass(frozen=True)
class PodTick:
    """One pod's tick of the planner loop, with the engine's step and the tokens finished since the last."""

    outcome: Outcome
    step: int
    new_tokens: int


def _switched_message(pod: str, ev: ReconfigEvent) -> str:
    took = "?" if ev.actual_ms is None else f"{ev.actual_ms:.0f}"
    return (
        f"{pod}: {ev.src} -> {ev.dst} at step {ev.step} ({ev.method}; predicted {ev.predicted_ms:.0f} ms, "
        f"took {took} ms)"
    )


def apply_ticks(st: RolloutJobStatus, ticks: list[PodTick], now: datetime) -> list[Event]:
    """Update ``st`` (pods' steps, tokens and switch counts; reconfigurations; last decisions)."""
    events: list[Event] = []
    by_name = {p.name: i for i, p in enumerate(st.pods)}
    for t in ticks:
        o = t.outcome
        i = by_name.get(o.pod)
        if i is None:
            continue
        pod = st.pods[i]
        st.pods[i] = pod.model_copy(
            update={
                "step": t.step,
                "tokens": pod.tokens + t.new_tokens,
                "reconfigurations": pod.reconfigurations + len(o.new_events),
            }
        )
        for ev in o.new_events:
            if ev.outcome != "committed":
                why = f"{o.pod}: {ev.src} -> {ev.dst} rolled back ({ev.error or ev.reason})"
                events.append(Event("Warning", "ReconfigurationRolledBack", why))
                continue
            st.reconfigurations += 1
            events.append(Event("Normal", "Reconfigured", _switched_message(o.pod, ev)))
            for j in range(len(st.last_decisions) - 1, -1, -1):
                d = st.last_decisions[j]
                if d.pod == o.pod and d.actual_cost_ms is None and d.to_layout == str(ev.dst):
                    upd = {"actual_cost_ms": ev.actual_ms, "step": ev.step, "method": ev.method}
                    st.last_decisions[j] = d.model_copy(update=upd)
                    break
            else:  # a later trigger of a pushed chain, or a switch the operator did not ask for
                facts = asdict(unasked_switch(ev))
                del facts["running_requests"]
                st.last_decisions.append(
                    DecisionRecord(
                        time=iso(now), pod=o.pod, actual_cost_ms=ev.actual_ms, step=ev.step, **facts
                    )
                )
        if o.pushed:
            dec = o.result.decision
            st.last_decisions.append(
                DecisionRecord(
                    time=iso(now),
                    pod=o.pod,
                    from_layout=str(o.result.inputs["layout"]),
                    to_layout=str(dec.target),
                    method=dec.method or "auto",
                    reason=dec.reason,
                    predicted_gain_ms=round(dec.predicted_gain_ms, 3),
                    predicted_cost_ms=round(dec.predicted_cost_ms, 3),
                )
            )
            gain, cost = dec.predicted_gain_ms, dec.predicted_cost_ms
            src = o.result.inputs["layout"]
            msg = f"{o.pod}: {src} -> {dec.target} (gain {gain:.0f} ms > cost {cost:.0f} ms)"
            events.append(Event("Normal", "ReconfigurationPlanned", msg))
    del st.last_decisions[:-LAST_DECISIONS]
    return events
