"""Typed repository functions over the profile/decision database (profiles here; jobs, finished lengths
and decisions in ``runs``, re-exported).

Each function takes an open ``Session`` and only flushes: the caller owns the transaction, e.g.::

    with Session(engine) as session, session.begin():
        profile_id = save_profile(session, profile)
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from rollout_worker.errors import UserError
from sqlalchemy import case, func, insert, select
from sqlalchemy.orm import Session, selectinload

from rollout_profiler.profile import CostModel, KVCapacity, ModelShape, Profile, ReconfigPoint, StepPoint
from rollout_profiler.store.checks import check_lengths
from rollout_profiler.store.models import ProfileRow, ReconfigCostPointRow, StepLatencyPointRow
from rollout_profiler.store.records import ProfileSummary
from rollout_profiler.store.runs import (
    add_finished_lengths,
    finish_decision,
    finish_job,
    finished_lengths_for_model,
    get_job,
    list_decisions,
    record_decision,
    record_job,
)

__all__ = [
    "add_finished_lengths",
    "find_profile",
    "find_profile_id",
    "finish_decision",
    "finish_job",
    "finished_lengths_for_model",
    "get_job",
    "list_decisions",
    "list_profiles",
    "load_profile",
    "record_decision",
    "record_job",
    "save_profile",
]

# find_profile prefers real measurements over estimates, then the newest.
_METHOD_RANK = {"measured": 0, "shard-equivalent": 1, "modelled": 2}


def _parse_created(text: str) -> datetime | None:
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


# --- profiles -------------------------------------------------------------------------------------------


def save_profile(session: Session, profile: Profile) -> int:
    """Store a validated profile with all its points; returns its new id."""
    where = f"profile {profile.name!r}"
    profile.validate(where)
    seen: set[tuple[int, int, int, int]] = set()
    for p in profile.step_latency:
        key = (p.replicas, p.tp, p.batch, p.context)
        if key in seen:
            raise UserError(
                f"{where}: step_latency has two points for layout {p.replicas}x{p.tp}, "
                f"batch {p.batch}, context {p.context}"
            )
        seen.add(key)
    shape = dataclasses.asdict(profile.model)
    values: dict[str, Any] = {
        **{k: v for k, v in shape.items() if k != "name"},
        "name": profile.name,
        "model_name": profile.model.name,
        "shape_hash": profile.model.shape_hash,
        "engine": profile.engine,
        "device_kind": profile.device_kind,
        "device_count": profile.device_count,
        "device_name": profile.device_name,
        "dtype": profile.dtype,
        "method": profile.method,
        "provenance": profile.provenance,
        "costs": dataclasses.asdict(profile.costs),
        "kv_capacity": None if profile.kv_capacity is None else profile.kv_capacity.to_dict(),
        "created": _parse_created(profile.created),
        "created_text": profile.created,
    }
    check_lengths(ProfileRow.__table__, values, where)
    row = ProfileRow(**values)
    session.add(row)
    session.flush()
    steps = [{"profile_id": row.id, **dataclasses.asdict(p)} for p in profile.step_latency]
    session.execute(insert(StepLatencyPointRow), steps)
    if profile.reconfig_cost:
        points = [{"profile_id": row.id, **dataclasses.asdict(p)} for p in profile.reconfig_cost]
        for i, point in enumerate(points):
            check_lengths(ReconfigCostPointRow.__table__, point, f"{where}: reconfig_cost[{i}]")
        session.execute(insert(ReconfigCostPointRow), points)
    return row.id


def load_profile(session: Session, profile_id: int) -> Profile:
    row = session.get(
        ProfileRow,
        profile_id,
        options=[selectinload(ProfileRow.step_points), selectinload(ProfileRow.reconfig_points)],
    )
    if row is None:
        raise UserError(f"no profile with id {profile_id} in the database")
    return Profile(
        name=row.name,
        model=ModelShape(
            name=row.model_name,
            architecture=row.architecture,
            hidden_size=row.hidden_size,
            num_layers=row.num_layers,
            num_heads=row.num_heads,
            num_kv_heads=row.num_kv_heads,
            head_dim=row.head_dim,
            intermediate_size=row.intermediate_size,
            vocab_size=row.vocab_size,
        ),
        engine=row.engine,
        device_kind=row.device_kind,
        device_count=row.device_count,
        device_name=row.device_name,
        dtype=row.dtype,
        method=row.method,
        step_latency=[StepPoint(p.replicas, p.tp, p.batch, p.context, p.ms) for p in row.step_points],
        reconfig_cost=[
            ReconfigPoint(p.src, p.dst, p.method, p.tokens, p.bytes, p.ms) for p in row.reconfig_points
        ],
        costs=CostModel(**row.costs),
        provenance=dict(row.provenance),
        created=row.created_text,
        kv_capacity=None if row.kv_capacity is None else KVCapacity.from_dict(row.kv_capacity),
    )


def list_profiles(session: Session) -> list[ProfileSummary]:
    steps = (
        select(func.count())
        .where(StepLatencyPointRow.profile_id == ProfileRow.id)
        .correlate(ProfileRow)
        .scalar_subquery()
    )
    reconfigs = (
        select(func.count())
        .where(ReconfigCostPointRow.profile_id == ProfileRow.id)
        .correlate(ProfileRow)
        .scalar_subquery()
    )
    rows = session.execute(select(ProfileRow, steps, reconfigs).order_by(ProfileRow.id))
    return [
        ProfileSummary(
            id=r.id,
            name=r.name,
            model_name=r.model_name,
            shape_hash=r.shape_hash,
            device_kind=r.device_kind,
            device_count=r.device_count,
            dtype=r.dtype,
            method=r.method,
            created=r.created_text,
            stored_at=r.stored_at,
            step_points=n_steps,
            reconfig_points=n_reconfigs,
        )
        for r, n_steps, n_reconfigs in rows
    ]


def find_profile_id(
    session: Session, shape_hash: str, device_kind: str, device_count: int, dtype: str
) -> int | None:
    """The best stored profile for this model shape on this device and dtype: measured before
    shard-equivalent before modelled, then the newest. None when there is none."""
    rank = case(_METHOD_RANK, value=ProfileRow.method, else_=len(_METHOD_RANK))
    query = (
        select(ProfileRow.id)
        .where(
            ProfileRow.shape_hash == shape_hash,
            ProfileRow.device_kind == device_kind,
            ProfileRow.device_count == device_count,
            ProfileRow.dtype == dtype,
        )
        .order_by(rank, ProfileRow.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def find_profile_named(session: Session, name: str) -> Profile | None:
    """The newest stored profile of this name, or None (one query)."""
    query = select(ProfileRow.id).where(ProfileRow.name == name).order_by(ProfileRow.id.desc()).limit(1)
    found = session.scalars(query).first()
    return None if found is None else load_profile(session, found)


def find_profile(
    session: Session, shape_hash: str, device_kind: str, device_count: int, dtype: str
) -> Profile | None:
    found = find_profile_id(session, shape_hash, device_kind, device_count, dtype)
    return None if found is None else load_profile(session, found)
