"""This ledger's own installation id (what the provider is sent as a call's key is a
digest of it and the attempt key, so two ledgers on one API key never adopt each
other's calls), and the digest of each attempt's request (a found answer is adopted
only for the same request).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

#: schema.UTCDateTime as it renders.
When = sa.DateTime(timezone=True)


def upgrade() -> None:
    table = op.create_table(
        "installation",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("installation_id", sa.String(64), nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_installation_one_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_installation")),
    )
    op.bulk_insert(
        table,
        [{"id": 1, "installation_id": _new_installation_id(), "created_at": _now()}],
    )
    op.add_column("attempts", sa.Column("request_digest", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("request_digest")
    op.drop_table("installation")


def _new_installation_id() -> str:
    """A new installation id (schema.new_installation_id)."""
    return uuid.uuid4().hex


def _now() -> datetime:
    """Now, as schema.UTCDateTime stores it: UTC, its wall time on SQLite."""
    now = datetime.now(UTC)
    return now.replace(tzinfo=None) if op.get_bind().dialect.name == "sqlite" else now
