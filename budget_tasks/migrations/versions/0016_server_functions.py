"""Admission and settlement as one statement each on PostgreSQL: the server-side
functions ``budget_tasks_admit`` and ``budget_tasks_finish`` (see
``budget_tasks.ledger.functions``). SQLite has none: it runs the statement path.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

from budget_tasks.ledger.functions import DROP_DDL, FUNCTIONS_DDL

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in FUNCTIONS_DDL:
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in DROP_DDL:
        op.execute(statement)
