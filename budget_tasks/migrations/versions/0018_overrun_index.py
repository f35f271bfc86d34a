"""A parent's overrun rolls up its escrowed tenants': the report (a metrics scrape,
``budget-tasks status``) reads the periods charged above their reservations, which are
few, by a partial index, not the whole history of periods.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_budget_periods_overrun",
        "budget_periods",
        ["period_start"],
        postgresql_where=sa.text("overrun > 0"),
        sqlite_where=sa.text("overrun > 0"),
    )


def downgrade() -> None:
    op.drop_index("ix_budget_periods_overrun", table_name="budget_periods")
