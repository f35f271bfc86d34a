"""The references from attempts and the journal to a budget and its period are checked
at COMMIT (DEFERRABLE INITIALLY DEFERRED): checked at each INSERT, they locked the hot
period row FOR KEY SHARE before the transaction's own UPDATE of it, and one hot row's
lockers piled up into MultiXacts, about 9 per admission and settlement cycle, halving
what one budget admits at 32 processes. PostgreSQL only: SQLite serialises its writes,
so its checks keep their place.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

HOT_KEYS = (
    ("attempts", "fk_attempts_budget_id_budgets"),
    ("attempts", "fk_attempts_period_id_budget_periods"),
    ("journal", "fk_journal_period_id_budget_periods"),
)


def upgrade() -> None:
    _set("DEFERRABLE INITIALLY DEFERRED")


def downgrade() -> None:
    _set("NOT DEFERRABLE")


def _set(mode: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, name in HOT_KEYS:
        op.execute(f"ALTER TABLE {table} ALTER CONSTRAINT {name} {mode}")
