"""An index on budget_periods.period_start: the report (a metrics scrape, `budget-tasks
status`) reads each budget's current period, and the one before it, by their starts,
one row per budget; without it, a join on the computed start scanned every period the
budgets ever had (2x the scrape at 91,000 periods). And a partial index of the open
periods: opening a period closes the open ones before it, which read every period the
budget ever had.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_budget_periods_period_start", "budget_periods", ["period_start"])
    op.create_index(
        "ix_budget_periods_open",
        "budget_periods",
        ["budget_id"],
        postgresql_where=sa.text("closed_at IS NULL"),
        sqlite_where=sa.text("closed_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_budget_periods_open", table_name="budget_periods")
    op.drop_index("ix_budget_periods_period_start", table_name="budget_periods")
