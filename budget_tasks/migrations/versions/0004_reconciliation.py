"""What reconciliation and the stale-hold alert need on attempts, and each operation's
payload (task and arguments) so that it can be enqueued again.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

#: schema.UTCDateTime as it renders.
When = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("lookup", sa.String(32), nullable=True))
        batch.add_column(sa.Column("model", sa.String(100), nullable=True))
        batch.add_column(sa.Column("response_id", sa.String(255), nullable=True))
        batch.add_column(sa.Column("lookups", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("next_lookup_at", When, nullable=True))
        batch.add_column(sa.Column("flagged_at", When, nullable=True))
    op.add_column("operations", sa.Column("payload", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("operations", "payload")
    with op.batch_alter_table("attempts") as batch:
        for column in ("flagged_at", "next_lookup_at", "lookups", "response_id", "model", "lookup"):
            batch.drop_column(column)
