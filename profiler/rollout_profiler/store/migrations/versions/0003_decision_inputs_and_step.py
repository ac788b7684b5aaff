"""Decisions record their inputs and the engine step at which the switch ran.

``decisions.inputs``: a summary of what the planner saw (running, waiting and finished requests, step
latency, the predictor's source), as JSON; ``decisions.step``: the engine's step at which the switch ran
(NULL until it ran, and for decisions made before this revision).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.add_column(sa.Column("inputs", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("step", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("step")
        batch.drop_column("inputs")
