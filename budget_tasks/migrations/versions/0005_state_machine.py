"""What the one state machine needs: each labelled call's position, the usage a run
recorded before its outcome became unknown (proof of billing), the answer a
reconciliation found, the client timeout an attempt was sent with; and periods that
close before their unused amount is carried.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: schema.UTCDateTime as it renders.
When = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Plain ADD COLUMN (nullable, or with a constant default) needs no table rebuild on
    # SQLite: the journal's foreign keys to attempts and budget_periods stay untouched.
    op.add_column("attempts", sa.Column("step", sa.String(255), nullable=True))
    op.add_column("attempts", sa.Column("recorded_actual", sa.BigInteger, nullable=True))
    op.add_column("attempts", sa.Column("answer", sa.Text, nullable=True))
    op.add_column("attempts", sa.Column("timeout_ms", sa.BigInteger, nullable=True))
    # A labelled call's first attempt was keyed by its position: that is its step.
    op.execute("UPDATE attempts SET step = key WHERE label IS NOT NULL")
    op.add_column("budget_periods", sa.Column("closed_at", When, nullable=True))
    op.add_column(
        "budget_periods",
        sa.Column("carried_out", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    with op.batch_alter_table("budget_periods") as batch:
        batch.drop_column("carried_out")
        batch.drop_column("closed_at")
    with op.batch_alter_table("attempts") as batch:
        for column in ("timeout_ms", "answer", "recorded_actual", "step"):
            batch.drop_column(column)
