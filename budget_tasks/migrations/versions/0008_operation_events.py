"""What operators did to an operation: reopening a failed one, with who and why.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: The ledger's id and timestamp types as they render (schema.Id, schema.UTCDateTime).
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "operation_events",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("operation_id", Id, sa.ForeignKey("operations.id"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("from_status", sa.String(16), nullable=False),
        sa.Column("to_status", sa.String(16), nullable=False),
        sa.Column("by", sa.String(100), nullable=False),
        sa.Column("note", sa.Text, nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.CheckConstraint("kind IN ('reopen')", name="kind_known"),
    )
    op.create_index("ix_operation_events_operation_id", "operation_events", ["operation_id"])


def downgrade() -> None:
    op.drop_index("ix_operation_events_operation_id", "operation_events")
    op.drop_table("operation_events")
