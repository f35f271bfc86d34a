"""Escrow: a budget may admit against grants drawn from its ancestors' periods, so
that tenants under one parent do not all write the parent's period row. A period row
keeps what it drew (``drawn``) and what it granted below (``granted``, counted against
its cap like a hold); the journal records each grant and return in both. And slices:
a budget split into rows that share its cap, each an escrowed budget under it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

#: The journal's append-only triggers on SQLite (as 0001 made them).
SQLITE_APPEND_ONLY = (
    """CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
    """CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
)

KINDS = (
    "kind IN ('hold', 'release', 'charge', 'adjustment', 'cap', 'freeze', 'unfreeze', "
    "'reopen', 'grant', 'return')"
)
OLD_KINDS = (
    "kind IN ('hold', 'release', 'charge', 'adjustment', 'cap', 'freeze', 'unfreeze', 'reopen')"
)


def upgrade() -> None:
    with op.batch_alter_table("budgets") as batch:
        batch.add_column(
            sa.Column(
                "escrow",
                sa.Boolean(create_constraint=False),
                nullable=False,
                server_default=sa.false(),
            )
        )
        batch.add_column(sa.Column("slices", sa.Integer, nullable=False, server_default="1"))
        batch.add_column(
            sa.Column("slice_of", sa.BigInteger().with_variant(sa.Integer(), "sqlite"))
        )
        batch.create_foreign_key(
            op.f("fk_budgets_slice_of_budgets"), "budgets", ["slice_of"], ["id"]
        )
        batch.create_check_constraint(op.f("ck_budgets_slices_positive"), "slices >= 1")
    with op.batch_alter_table("budget_periods") as batch:
        batch.add_column(sa.Column("drawn", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("granted", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("drawn_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_check_constraint(op.f("ck_budget_periods_drawn_not_negative"), "drawn >= 0")
        batch.create_check_constraint(
            op.f("ck_budget_periods_granted_not_negative"), "granted >= 0"
        )
    with op.batch_alter_table("journal") as batch:
        batch.add_column(
            sa.Column("drawn_delta", sa.BigInteger, nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("granted_delta", sa.BigInteger, nullable=False, server_default="0")
        )
        batch.drop_constraint(op.f("ck_journal_kind_known"), type_="check")
        batch.create_check_constraint(op.f("ck_journal_kind_known"), KINDS)
    _triggers()


def downgrade() -> None:
    # A downgrade over grant rows fails on the old kinds: the journal is append-only.
    with op.batch_alter_table("journal") as batch:
        batch.drop_constraint(op.f("ck_journal_kind_known"), type_="check")
        batch.create_check_constraint(op.f("ck_journal_kind_known"), OLD_KINDS)
        batch.drop_column("granted_delta")
        batch.drop_column("drawn_delta")
    with op.batch_alter_table("budget_periods") as batch:
        batch.drop_constraint(op.f("ck_budget_periods_granted_not_negative"), type_="check")
        batch.drop_constraint(op.f("ck_budget_periods_drawn_not_negative"), type_="check")
        batch.drop_column("drawn_at")
        batch.drop_column("granted")
        batch.drop_column("drawn")
    with op.batch_alter_table("budgets") as batch:
        batch.drop_constraint(op.f("ck_budgets_slices_positive"), type_="check")
        batch.drop_constraint(op.f("fk_budgets_slice_of_budgets"), type_="foreignkey")
        batch.drop_column("slice_of")
        batch.drop_column("slices")
        batch.drop_column("escrow")
    _triggers()


def _triggers() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # The batch rebuild dropped the journal and with it its triggers: put them back.
        for statement in SQLITE_APPEND_ONLY:
            op.execute(statement)
