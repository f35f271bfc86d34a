"""A provider's rate limits held across the fleet: ``rate_windows``, one token bucket
per provider, scope and kind of limit (requests, tokens, input or output tokens per
minute), its level in thousandths of a unit and the moment it was last refilled
(milliseconds since the epoch).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

#: The ledger's id type as it renders (schema.Id).
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
#: The kinds of limit, as the ledger's schema had them when this was written.
KINDS = "kind IN ('requests', 'tokens', 'input_tokens', 'output_tokens')"


def upgrade() -> None:
    op.create_table(
        "rate_windows",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("scope", sa.String(100), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("per_minute", sa.BigInteger, nullable=False),
        sa.Column("level", sa.BigInteger, nullable=False),
        sa.Column("refilled_ms", sa.BigInteger, nullable=False),
        sa.UniqueConstraint("provider", "scope", "kind"),
        sa.CheckConstraint("per_minute > 0", name="per_minute_positive"),
        sa.CheckConstraint("level >= 0", name="level_not_negative"),
        sa.CheckConstraint(KINDS, name="kind_known"),
    )


def downgrade() -> None:
    op.drop_table("rate_windows")
