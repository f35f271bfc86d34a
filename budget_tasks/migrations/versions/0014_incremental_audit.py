"""An incremental audit: each period's journal sums as the last audit proved them, and
the journal position they reach, so that the next audit reads only the journal rows
after it (the open periods and the periods those rows touch), not the whole journal.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "audit_checkpoints",
        sa.Column("period_id", Id, nullable=False),
        sa.Column("held", sa.BigInteger, nullable=False),
        sa.Column("spent", sa.BigInteger, nullable=False),
        sa.Column("overrun", sa.BigInteger, nullable=False),
        sa.Column("drawn", sa.BigInteger, nullable=False),
        sa.Column("granted", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("period_id", name=op.f("pk_audit_checkpoints")),
        sa.ForeignKeyConstraint(
            ["period_id"],
            ["budget_periods.id"],
            name=op.f("fk_audit_checkpoints_period_id_budget_periods"),
        ),
    )
    op.create_table(
        "audit_position",
        sa.Column("id", sa.Integer, autoincrement=False, nullable=False),
        sa.Column("journal_id", sa.BigInteger, nullable=False),
        sa.Column("audited_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_position")),
        sa.CheckConstraint("id = 1", name=op.f("ck_audit_position_one_row")),
    )


def downgrade() -> None:
    op.drop_table("audit_position")
    op.drop_table("audit_checkpoints")
