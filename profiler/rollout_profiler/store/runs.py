"""Repository functions for rollout jobs, their finished lengths (the predictor's prior) and the
planner's decisions. Each takes an open ``Session`` and only flushes; the caller owns the transaction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from rollout_profiler.profile import KV_METHODS
from rollout_profiler.store.checks import aware, check_lengths
from rollout_profiler.store.models import DecisionRow, FinishedLengthRow, JobRow
from rollout_profiler.store.records import DecisionRecord, JobRecord, LengthSample


def _job_row(session: Session, job_id: int) -> JobRow:
    row = session.get(JobRow, job_id)
    if row is None:
        raise UserError(f"no job with id {job_id} in the database")
    return row


def record_job(
    session: Session,
    *,
    name: str,
    namespace: str,
    spec_hash: str,
    model_shape_hash: str,
    started_at: datetime | None = None,
) -> int:
    values = {
        "name": name,
        "namespace": namespace,
        "spec_hash": spec_hash,
        "model_shape_hash": model_shape_hash,
    }
    check_lengths(JobRow.__table__, values, f"job {namespace}/{name}")
    row = JobRow(**values, started_at=aware(started_at, "started_at"))
    session.add(row)
    session.flush()
    return row.id


def finish_job(
    session: Session,
    job_id: int,
    *,
    outcome: str,
    ended_at: datetime | None = None,
    generation_seconds: float | None = None,
) -> None:
    row = _job_row(session, job_id)
    ended = aware(ended_at, "ended_at")
    if ended < row.started_at:
        raise UserError(f"job {job_id}: ended_at {ended.isoformat()} is before its start")
    if generation_seconds is not None and generation_seconds < 0:
        raise UserError(f"job {job_id}: generation_seconds must be >= 0, got {generation_seconds}")
    check_lengths(JobRow.__table__, {"outcome": outcome}, f"job {job_id}")
    row.ended_at, row.outcome, row.generation_seconds = ended, outcome, generation_seconds
    session.flush()


def get_job(session: Session, job_id: int) -> JobRecord:
    r = _job_row(session, job_id)
    return JobRecord(**{f.name: getattr(r, f.name) for f in dataclasses.fields(JobRecord)})


def add_finished_lengths(
    session: Session, job_id: int, lengths: Sequence[int], capped: Sequence[bool] | None = None
) -> int:
    """Bulk-insert the output lengths of a job's finished requests; returns how many were stored."""
    _job_row(session, job_id)
    flags: Iterable[bool] = [False] * len(lengths) if capped is None else capped
    if capped is not None and len(capped) != len(lengths):
        raise UserError(f"job {job_id}: {len(lengths)} lengths but {len(capped)} capped flags")
    rows = []
    for i, (length, cap) in enumerate(zip(lengths, flags, strict=True)):
        if int(length) != length or length < 0:
            raise UserError(f"job {job_id}: finished length [{i}] must be an integer >= 0, got {length!r}")
        rows.append({"job_id": job_id, "length": int(length), "capped": bool(cap)})
    if rows:
        session.execute(insert(FinishedLengthRow), rows)
    return len(rows)


def finished_lengths_for_model(session: Session, shape_hash: str) -> list[LengthSample]:
    """Every finished length recorded for jobs of this model shape, oldest first (predictor prior)."""
    query = (
        select(FinishedLengthRow.length, FinishedLengthRow.capped)
        .join(JobRow, JobRow.id == FinishedLengthRow.job_id)
        .where(JobRow.model_shape_hash == shape_hash)
        .order_by(FinishedLengthRow.id)
    )
    return [LengthSample(length, capped) for length, capped in session.execute(query)]


# --- decisions --------------------------------------------------------------------------------------------


def record_decision(
    session: Session,
    *,
    pod: str,
    running_requests: int,
    from_layout: Layout | str,
    to_layout: Layout | str,
    predicted_gain_ms: float,
    predicted_cost_ms: float,
    outcome: str,
    reason: str = "",
    job_id: int | None = None,
    method: str | None = None,
    actual_cost_ms: float | None = None,
    at: datetime | None = None,
    inputs: dict[str, Any] | None = None,
) -> int:
    if method is not None and method not in KV_METHODS:
        raise UserError(f"decision on {pod}: method must be one of {KV_METHODS} or None, got {method!r}")
    if running_requests < 0:
        raise UserError(f"decision on {pod}: running_requests must be >= 0, got {running_requests}")
    if job_id is not None:
        _job_row(session, job_id)
    values: dict[str, Any] = {
        "job_id": job_id,
        "pod": pod,
        "at": aware(at, "at"),
        "running_requests": running_requests,
        "from_layout": str(Layout.parse(str(from_layout), what="from_layout")),
        "to_layout": str(Layout.parse(str(to_layout), what="to_layout")),
        "method": method,
        "predicted_gain_ms": float(predicted_gain_ms),
        "predicted_cost_ms": float(predicted_cost_ms),
        "actual_cost_ms": None if actual_cost_ms is None else float(actual_cost_ms),
        "outcome": outcome,
        "reason": reason,
        "inputs": inputs,
    }
    check_lengths(DecisionRow.__table__, values, f"decision on {pod}")
    row = DecisionRow(**values)
    session.add(row)
    session.flush()
    return row.id


def finish_decision(
    session: Session, decision_id: int, *, outcome: str, actual_cost_ms: float | None, step: int | None = None
) -> None:
    """Record what came of a decision once the switch is over (or failed), and the step it ran at."""
    row = session.get(DecisionRow, decision_id)
    if row is None:
        raise UserError(f"no decision with id {decision_id} in the database")
    check_lengths(DecisionRow.__table__, {"outcome": outcome}, f"decision {decision_id}")
    row.outcome, row.actual_cost_ms, row.step = outcome, actual_cost_ms, step
    session.flush()


def list_decisions(session: Session, job_id: int | None = None) -> list[DecisionRecord]:
    """Decisions of one job (every decision when ``job_id`` is None), in time order."""
    query = select(DecisionRow).order_by(DecisionRow.at, DecisionRow.id)
    if job_id is not None:
        query = query.where(DecisionRow.job_id == job_id)
    return [
        DecisionRecord(**{f.name: getattr(r, f.name) for f in dataclasses.fields(DecisionRecord)})
        for r in session.scalars(query)
    ]
