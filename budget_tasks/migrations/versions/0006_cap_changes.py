"""Changes of a budget's cap recorded in the journal, a journal that refuses TRUNCATE
as it refuses UPDATE and DELETE, and each period's overrun (what settlements charged
above their reservations), which the metrics read from the ledger.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: schema.Id as it renders.
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
#: The journal's append-only triggers on SQLite (as 0001 made them).
SQLITE_APPEND_ONLY = (
    """CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
    """CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
)
#: TRUNCATE fires no row trigger, so it has its own (PostgreSQL).
NO_TRUNCATE_DDL = """CREATE TRIGGER journal_no_truncate BEFORE TRUNCATE ON journal
FOR EACH STATEMENT EXECUTE FUNCTION budget_tasks_journal_append_only()"""

KINDS = "kind IN ('hold', 'release', 'charge', 'adjustment', 'cap')"
OLD_KINDS = "kind IN ('hold', 'release', 'charge', 'adjustment')"


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.add_column(
        "budget_periods",
        sa.Column("overrun", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.execute(
        "UPDATE budget_periods SET overrun = COALESCE((SELECT SUM(j.spent_delta + j.held_delta) "
        "FROM journal j WHERE j.period_id = budget_periods.id AND j.kind = 'charge' "
        "AND j.spent_delta + j.held_delta > 0), 0)"
    )
    with op.batch_alter_table("journal") as batch:
        batch.alter_column("attempt_id", existing_type=Id, nullable=True)
        batch.add_column(sa.Column("cap_delta", sa.BigInteger, nullable=False, server_default="0"))
        batch.drop_constraint(op.f("ck_journal_kind_known"), type_="check")
        batch.create_check_constraint(op.f("ck_journal_kind_known"), KINDS)
    if dialect == "sqlite":
        # The batch rebuild dropped the table and with it its triggers: put them back.
        for statement in SQLITE_APPEND_ONLY:
            op.execute(statement)
    else:
        op.execute(NO_TRUNCATE_DDL)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect != "sqlite":
        op.execute("DROP TRIGGER IF EXISTS journal_no_truncate ON journal")
    with op.batch_alter_table("journal") as batch:
        batch.drop_constraint(op.f("ck_journal_kind_known"), type_="check")
        batch.create_check_constraint(op.f("ck_journal_kind_known"), OLD_KINDS)
        batch.drop_column("cap_delta")
        batch.alter_column("attempt_id", existing_type=Id, nullable=False)
    if dialect == "sqlite":
        for statement in SQLITE_APPEND_ONLY:
            op.execute(statement)
    with op.batch_alter_table("budget_periods") as batch:
        batch.drop_column("overrun")
