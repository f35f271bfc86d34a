"""An index on budget_periods.period_start: the report (a metrics scrape, `budget-tasks
status`) reads each budget's current period, and the one before it, by their starts,
one row per budget; without it, a join on the computed start scanned every period the
budgets ever had (2x the scrape at 91,000 periods).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_budget_periods_period_start", "budget_periods", ["period_start"])


def downgrade() -> None:
    op.drop_index("ix_budget_periods_period_start", table_name="budget_periods")
