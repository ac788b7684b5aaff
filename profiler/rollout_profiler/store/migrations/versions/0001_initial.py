"""Initial schema.

Profiles with their step-latency and reconfiguration-cost points, jobs with their finished lengths, and
planner decisions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 64-bit surrogate keys that still auto-increment on SQLite (only INTEGER PRIMARY KEY does there).
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
UTC_TIME = sa.DateTime(timezone=True)  # rollout_profiler.store.models.UTCDateTime


def _id(big: bool = False) -> sa.Column[int]:
    return sa.Column("id", BIG_ID if big else sa.Integer(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "jobs",
        _id(),
        sa.Column("name", sa.String(length=253), nullable=False),
        sa.Column("namespace", sa.String(length=253), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("model_shape_hash", sa.String(length=64), nullable=False),
        sa.Column("started_at", UTC_TIME, nullable=False),
        sa.Column("ended_at", UTC_TIME, nullable=True),
        sa.Column("generation_seconds", sa.Double(), nullable=True),
        sa.Column("outcome", sa.String(length=32), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint(
            "namespace", "name", "started_at", name=op.f("uq_jobs_namespace_name_started_at")
        ),
    )
    op.create_index(op.f("ix_jobs_model_shape_hash"), "jobs", ["model_shape_hash"])

    op.create_table(
        "profiles",
        _id(),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("shape_hash", sa.String(length=64), nullable=False),
        sa.Column("architecture", sa.String(length=200), nullable=False),
        *(
            sa.Column(name, sa.Integer(), nullable=False)
            for name in (
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
            )
        ),
        sa.Column("engine", sa.String(length=200), nullable=False),
        sa.Column("device_kind", sa.String(length=64), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("device_name", sa.String(length=200), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("method", sa.String(length=32), nullable=False),
        sa.Column("provenance", sa.JSON(), nullable=False),
        sa.Column("costs", sa.JSON(), nullable=False),
        sa.Column("created", UTC_TIME, nullable=True),
        sa.Column("created_text", sa.String(length=64), nullable=False),
        sa.Column("stored_at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_profiles")),
    )
    op.create_index(op.f("ix_profiles_name"), "profiles", ["name"])
    op.create_index(
        op.f("ix_profiles_shape_hash_device_kind_device_count_dtype"),
        "profiles",
        ["shape_hash", "device_kind", "device_count", "dtype"],
    )

    op.create_table(
        "decisions",
        _id(),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("pod", sa.String(length=253), nullable=False),
        sa.Column("at", UTC_TIME, nullable=False),
        sa.Column("running_requests", sa.Integer(), nullable=False),
        sa.Column("from_layout", sa.String(length=32), nullable=False),
        sa.Column("to_layout", sa.String(length=32), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=True),
        sa.Column("predicted_gain_ms", sa.Double(), nullable=False),
        sa.Column("predicted_cost_ms", sa.Double(), nullable=False),
        sa.Column("actual_cost_ms", sa.Double(), nullable=True),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_decisions_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_decisions")),
    )
    op.create_index(op.f("ix_decisions_job_id_at"), "decisions", ["job_id", "at"])
    op.create_index(op.f("ix_decisions_pod_at"), "decisions", ["pod", "at"])

    op.create_table(
        "finished_lengths",
        _id(big=True),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("length", sa.Integer(), nullable=False),
        sa.Column("capped", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_finished_lengths_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_finished_lengths")),
    )
    op.create_index(op.f("ix_finished_lengths_job_id"), "finished_lengths", ["job_id"])

    op.create_table(
        "reconfig_cost_points",
        _id(big=True),
        sa.Column("profile_id", sa.Integer(), nullable=False),
        sa.Column("src", sa.String(length=32), nullable=False),
        sa.Column("dst", sa.String(length=32), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("ms", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["profile_id"],
            ["profiles.id"],
            name=op.f("fk_reconfig_cost_points_profile_id_profiles"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconfig_cost_points")),
    )
    op.create_index(op.f("ix_reconfig_cost_points_profile_id"), "reconfig_cost_points", ["profile_id"])

    op.create_table(
        "step_latency_points",
        _id(big=True),
        sa.Column("profile_id", sa.Integer(), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("context", sa.Integer(), nullable=False),
        sa.Column("ms", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["profile_id"],
            ["profiles.id"],
            name=op.f("fk_step_latency_points_profile_id_profiles"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_latency_points")),
        # Also the index for look-ups by profile_id (its leading column).
        sa.UniqueConstraint(
            "profile_id",
            "replicas",
            "tp",
            "batch",
            "context",
            name=op.f("uq_step_latency_points_profile_id_replicas_tp_batch_context"),
        ),
    )


def downgrade() -> None:
    # Children first; dropping a table drops its indexes.
    for table in (
        "step_latency_points",
        "reconfig_cost_points",
        "finished_lengths",
        "decisions",
        "profiles",
        "jobs",
    ):
        op.drop_table(table)
