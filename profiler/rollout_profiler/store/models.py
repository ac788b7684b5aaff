"""Tables of the profile/decision database (SQLAlchemy 2 typed declarative).

Every timestamp is timezone-aware UTC (``UTCDateTime`` also on SQLite, which stores naive values).
A change here needs a new Alembic revision under ``rollout_profiler/store/migrations/versions``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# A 64-bit surrogate key that still auto-increments on SQLite (only INTEGER PRIMARY KEY does there).
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend; naive datetimes are refused."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        datetime: UTCDateTime,
        float: Double,
    }


class ProfileRow(Base):
    """One ``Profile`` (see ``rollout_profiler.profile``); its points live in the two tables below."""

    __tablename__ = "profiles"
    # Leads with shape_hash, so it also serves look-ups by shape_hash alone.
    __table_args__ = (Index(None, "shape_hash", "device_kind", "device_count", "dtype"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    model_name: Mapped[str] = mapped_column(String(200))
    shape_hash: Mapped[str] = mapped_column(String(64))
    architecture: Mapped[str] = mapped_column(String(200))
    hidden_size: Mapped[int]
    num_layers: Mapped[int]
    num_heads: Mapped[int]
    num_kv_heads: Mapped[int]
    head_dim: Mapped[int]
    intermediate_size: Mapped[int]
    vocab_size: Mapped[int]
    engine: Mapped[str] = mapped_column(String(200))
    device_kind: Mapped[str] = mapped_column(String(64))
    device_count: Mapped[int]
    device_name: Mapped[str] = mapped_column(String(200))
    dtype: Mapped[str] = mapped_column(String(16))
    method: Mapped[str] = mapped_column(String(32))
    provenance: Mapped[dict[str, Any]]
    costs: Mapped[dict[str, Any]]
    kv_capacity: Mapped[dict[str, Any] | None]  # KV tokens per replica by TP size, and their basis (0002)
    created: Mapped[datetime | None]  # the profile's "created", parsed (NULL when not an aware ISO time)
    created_text: Mapped[str] = mapped_column(String(64))  # ... and verbatim, for an exact round trip
    stored_at: Mapped[datetime] = mapped_column(default=utcnow)

    step_points: Mapped[list[StepLatencyPointRow]] = relationship(
        order_by="StepLatencyPointRow.id", cascade="all, delete-orphan", passive_deletes=True
    )
    reconfig_points: Mapped[list[ReconfigCostPointRow]] = relationship(
        order_by="ReconfigCostPointRow.id", cascade="all, delete-orphan", passive_deletes=True
    )


class StepLatencyPointRow(Base):
    __tablename__ = "step_latency_points"
    __table_args__ = (UniqueConstraint("profile_id", "replicas", "tp", "batch", "context"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    profile_id: Mapped[int] = mapped_column(ForeignKey("profiles.id", ondelete="CASCADE"))
    replicas: Mapped[int]
    tp: Mapped[int]
    batch: Mapped[int]
    context: Mapped[int]
    ms: Mapped[float]


class ReconfigCostPointRow(Base):
    __tablename__ = "reconfig_cost_points"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    profile_id: Mapped[int] = mapped_column(ForeignKey("profiles.id", ondelete="CASCADE"), index=True)
    src: Mapped[str] = mapped_column(String(32))
    dst: Mapped[str] = mapped_column(String(32))
    method: Mapped[str] = mapped_column(String(16))
    tokens: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)
    ms: Mapped[float]


class JobRow(Base):
    """One rollout job (a generation run of one model) as seen by the operator."""

    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("namespace", "name", "started_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(253))
    namespace: Mapped[str] = mapped_column(String(253))
    spec_hash: Mapped[str] = mapped_column(String(64))
    model_shape_hash: Mapped[str] = mapped_column(String(64), index=True)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    generation_seconds: Mapped[float | None]
    outcome: Mapped[str | None] = mapped_column(String(32))


class FinishedLengthRow(Base):
    """Output length of one finished request (``capped``: stopped by the length limit, so censored)."""

    __tablename__ = "finished_lengths"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    length: Mapped[int]
    capped: Mapped[bool] = mapped_column(Boolean)


class DecisionRow(Base):
    """One planner decision on one pod: switch (or not) from one layout to another, and what came of it."""

    __tablename__ = "decisions"
    __table_args__ = (Index(None, "job_id", "at"), Index(None, "pod", "at"))

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    pod: Mapped[str] = mapped_column(String(253))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    running_requests: Mapped[int]
    from_layout: Mapped[str] = mapped_column(String(32))
    to_layout: Mapped[str] = mapped_column(String(32))
    method: Mapped[str | None] = mapped_column(String(16))
    predicted_gain_ms: Mapped[float]
    predicted_cost_ms: Mapped[float]
    actual_cost_ms: Mapped[float | None]
    outcome: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)
    inputs: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # what the planner saw (revision 0003)
    step: Mapped[int | None]  # the engine step at which the switch ran (revision 0003)
