"""A job's rows in the database (SQLite by default, PostgreSQL in clusters), for `rolloutctl run` and the
operator alike: the job from its start to its end, its decisions, its finished lengths; and the prior
earlier jobs' lengths give the next."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.planning.tick import TickResult
from rollout_profiler.store import runs
from rollout_worker.api.plan import ReconfigEvent
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from rollout_operator.api.job import RolloutJobSpec, samples_hash
from rollout_operator.control.switches import unasked_switch

PRIOR_MIN_SAMPLES = 20  # fewer finished lengths of earlier jobs than this: no prior


def prior_for_model(session: Session, shape_hash: str) -> Prior | None:
    """The remaining-length prior from earlier jobs' finished lengths of this model shape (lengths the cap
    stopped count as censored), or None when there are too few."""
    earlier = runs.finished_lengths_for_model(session, shape_hash)
    if len(earlier) < PRIOR_MIN_SAMPLES:
        return None
    lengths = np.array([s.length for s in earlier], dtype=float)
    return Prior.from_samples(lengths, np.array([s.length if s.capped else np.inf for s in earlier]))


def start_job(db: Engine, name: str, namespace: str, spec: RolloutJobSpec, shape_hash: str) -> int:
    """The job's row (its samples' hash says which outputs it makes); returns its id."""
    with Session(db) as session, session.begin():
        return runs.record_job(
            session, name=name, namespace=namespace, spec_hash=samples_hash(spec), model_shape_hash=shape_hash
        )


def end_job(
    db: Engine,
    job_id: int,
    outcome: str,
    seconds: float | None = None,
    lengths: list[int] | None = None,
    capped: list[bool] | None = None,
) -> None:
    """The job's end (succeeded, failed, interrupted, deleted) and the lengths it finished, at once."""
    with Session(db) as session, session.begin():
        if lengths:
            runs.add_finished_lengths(session, job_id, lengths, capped or [False] * len(lengths))
        runs.finish_job(session, job_id, outcome=outcome, generation_seconds=seconds)


@dataclass
class DbRecorder:
    """Records each pushed decision (its inputs, predicted gain and cost, layout and method) and, once the
    switch ran, its actual cost and step; a decision whose plan a later push replaced before it fired is
    ``superseded``. Switches that ran later in a pushed chain get their own row."""

    db: Engine
    job_id: int | None

    def decided(self, pod: str, result: TickResult) -> int:
        d = result.decision
        running = int(result.inputs.get("running", 0))
        with Session(self.db) as session, session.begin():
            return runs.record_decision(
                session,
                job_id=self.job_id,
                pod=pod,
                running_requests=running,
                from_layout=str(result.inputs["layout"]),
                to_layout=d.target,
                method=d.method,
                predicted_gain_ms=d.predicted_gain_ms,
                predicted_cost_ms=d.predicted_cost_ms,
                outcome="pushed",
                reason=d.reason,
                inputs=result.inputs,
            )

    def switched(self, pod: str, decision_id: int | None, event: ReconfigEvent) -> None:
        with Session(self.db) as session, session.begin():
            if decision_id is None:  # a later trigger of a chain, or a switch nobody here asked for
                facts = asdict(unasked_switch(event))
                decision_id = runs.record_decision(
                    session, job_id=self.job_id, pod=pod, outcome="pushed", **facts
                )
            runs.finish_decision(
                session, decision_id, outcome=event.outcome, actual_cost_ms=event.actual_ms, step=event.step
            )

    def superseded(self, decision_id: int) -> None:
        with Session(self.db) as session, session.begin():
            runs.finish_decision(session, decision_id, outcome="superseded", actual_cost_ms=None)

    def lengths(self, lengths: list[int], capped: list[bool]) -> None:
        if self.job_id is None:
            return
        with Session(self.db) as session, session.begin():
            runs.add_finished_lengths(session, self.job_id, lengths, capped)
