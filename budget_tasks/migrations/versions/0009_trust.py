"""What a request allowed (its token bounds, which a reported usage is vetted against),
and who acted in the journal: every operator action (resolve, set-cap, freeze,
unfreeze, adjust, reopen) is a journal row naming its actor.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

#: The journal's append-only triggers on SQLite (as 0001 made them).
SQLITE_APPEND_ONLY = (
    """CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
    """CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
)

KINDS = "kind IN ('hold', 'release', 'charge', 'adjustment', 'cap', 'freeze', 'unfreeze', 'reopen')"
OLD_KINDS = "kind IN ('hold', 'release', 'charge', 'adjustment', 'cap')"


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("input_bound", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("output_bound", sa.BigInteger, nullable=True))
    _journal(KINDS, add_actor=True)


def downgrade() -> None:
    _journal(OLD_KINDS, add_actor=False)
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("output_bound")
        batch.drop_column("input_bound")


def _journal(kinds: str, *, add_actor: bool) -> None:
    # A downgrade over journal rows of the new kinds fails on the old constraint: the
    # journal is append-only, so they are never deleted to make it pass.
    with op.batch_alter_table("journal") as batch:
        if add_actor:
            batch.add_column(sa.Column("actor", sa.String(255), nullable=True))
        else:
            batch.drop_column("actor")
        batch.drop_constraint(op.f("ck_journal_kind_known"), type_="check")
        batch.create_check_constraint(op.f("ck_journal_kind_known"), kinds)
    if op.get_bind().dialect.name == "sqlite":
        # The batch rebuild dropped the table and with it its triggers: put them back.
        for statement in SQLITE_APPEND_ONLY:
            op.execute(statement)
