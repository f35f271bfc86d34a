"""Operations (business intents with a lease and a stored outcome), at-most-once side
effects, and the link from attempts to their operation.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

#: The ledger's id and timestamp types as they render (schema.Id, schema.UTCDateTime).
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "operations",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(255), nullable=False),
        sa.Column("task", sa.String(255), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("lease_owner", sa.String(255), nullable=True),
        sa.Column("lease_expires_at", When, nullable=True),
        sa.Column("runs", sa.Integer, nullable=False),
        sa.Column("deliveries", sa.Integer, nullable=False),
        sa.Column("replays", sa.Integer, nullable=False),
        sa.Column("next_reason", sa.String(32), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("updated_at", When, nullable=False),
        sa.Column("completed_at", When, nullable=True),
        sa.UniqueConstraint("key"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'succeeded', 'failed', 'unknown', 'retryable')",
            name="status_known",
        ),
    )
    op.create_table(
        "side_effects",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("operation_id", Id, sa.ForeignKey("operations.id"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("completed_at", When, nullable=True),
        sa.UniqueConstraint("operation_id", "name"),
        sa.CheckConstraint("state IN ('started', 'done')", name="state_known"),
    )
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("operation_id", Id, nullable=True))
        batch.add_column(sa.Column("label", sa.String(100), nullable=True))
        batch.add_column(
            sa.Column(
                "estimate_only",
                sa.Boolean(create_constraint=False),
                nullable=False,
                server_default=sa.false(),
            )
        )
        batch.create_foreign_key(
            "fk_attempts_operation_id_operations", "operations", ["operation_id"], ["id"]
        )
        batch.create_index("ix_attempts_operation_id", ["operation_id"])


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_index("ix_attempts_operation_id")
        batch.drop_constraint("fk_attempts_operation_id_operations", type_="foreignkey")
        batch.drop_column("estimate_only")
        batch.drop_column("label")
        batch.drop_column("operation_id")
    op.drop_table("side_effects")
    op.drop_table("operations")
