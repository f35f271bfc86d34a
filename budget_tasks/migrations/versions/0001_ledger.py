"""The ledger: budgets, budget periods, attempts and the append-only journal.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

#: The ledger's id and timestamp types as they render (schema.Id, schema.UTCDateTime).
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = sa.DateTime(timezone=True)

#: The journal's append-only triggers as this revision made them. (On PostgreSQL,
#: 0015 replaced the function with one that words its message without a format string.)
APPEND_ONLY_DDL: dict[str, tuple[str, ...]] = {
    "postgresql": (
        """CREATE OR REPLACE FUNCTION budget_tasks_journal_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the budget-tasks journal is append-only (% refused)', TG_OP;
END
$$""",
        """CREATE TRIGGER journal_append_only BEFORE UPDATE OR DELETE ON journal
FOR EACH ROW EXECUTE FUNCTION budget_tasks_journal_append_only()""",
    ),
    "sqlite": (
        """CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
        """CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
    ),
}


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=True),
        sa.Column("parent_id", Id, sa.ForeignKey("budgets.id"), nullable=True),
        sa.Column("cap", sa.BigInteger, nullable=False),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("renewal", sa.String(16), nullable=False),
        sa.Column("rollover_ceiling", sa.BigInteger, nullable=True),
        sa.Column("frozen", sa.Boolean(create_constraint=False), nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.UniqueConstraint("name"),
        sa.CheckConstraint("cap >= 0", name="cap_not_negative"),
        sa.CheckConstraint("period IN ('none', 'day', 'week', 'month')", name="period_known"),
        sa.CheckConstraint("renewal IN ('reset', 'rollover')", name="renewal_known"),
        sa.CheckConstraint(
            "rollover_ceiling IS NULL OR rollover_ceiling >= cap", name="ceiling_ge_cap"
        ),
        sa.CheckConstraint("parent_id IS NULL OR parent_id <> id", name="not_own_parent"),
    )
    op.create_table(
        "budget_periods",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("budget_id", Id, sa.ForeignKey("budgets.id"), nullable=False),
        sa.Column("period_start", When, nullable=False),
        sa.Column("cap", sa.BigInteger, nullable=False),
        sa.Column("spent", sa.BigInteger, nullable=False),
        sa.Column("held", sa.BigInteger, nullable=False),
        sa.Column("opened_at", When, nullable=False),
        sa.UniqueConstraint("budget_id", "period_start"),
        sa.CheckConstraint("cap >= 0", name="cap_not_negative"),
        sa.CheckConstraint("held >= 0", name="held_not_negative"),
        sa.CheckConstraint("spent >= 0", name="spent_not_negative"),
    )
    op.create_table(
        "attempts",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("budget_id", Id, sa.ForeignKey("budgets.id"), nullable=False),
        sa.Column("period_id", Id, sa.ForeignKey("budget_periods.id"), nullable=False),
        sa.Column("fingerprint", sa.String(255), nullable=True),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("amount", sa.BigInteger, nullable=False),
        sa.Column("actual", sa.BigInteger, nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("provider", sa.String(64), nullable=True),
        sa.Column("request_id", sa.String(255), nullable=True),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("sending_at", When, nullable=True),
        sa.Column("resolved_at", When, nullable=True),
        sa.UniqueConstraint("key"),
        sa.CheckConstraint("amount >= 0", name="amount_not_negative"),
        sa.CheckConstraint("actual IS NULL OR actual >= 0", name="actual_not_negative"),
        sa.CheckConstraint(
            "state IN ('reserved', 'sending', 'settled', 'released', 'unknown')",
            name="state_known",
        ),
        sa.CheckConstraint(
            "reason IN ('first', 'redelivery', 'rate_limited_retry', 'unknown_resend', 'manual')",
            name="reason_known",
        ),
        sa.CheckConstraint(
            "(state IN ('settled', 'released')) = (actual IS NOT NULL)",
            name="actual_iff_resolved",
        ),
    )
    op.create_index("ix_attempts_state_created_at", "attempts", ["state", "created_at"])
    op.create_table(
        "journal",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("attempt_id", Id, sa.ForeignKey("attempts.id"), nullable=False),
        sa.Column("period_id", Id, sa.ForeignKey("budget_periods.id"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("held_delta", sa.BigInteger, nullable=False),
        sa.Column("spent_delta", sa.BigInteger, nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("ref", sa.String(255), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.CheckConstraint(
            "kind IN ('hold', 'release', 'charge', 'adjustment')", name="kind_known"
        ),
    )
    op.create_index("ix_journal_attempt_id", "journal", ["attempt_id"])
    op.create_index("ix_journal_period_id", "journal", ["period_id"])
    for statement in APPEND_ONLY_DDL.get(op.get_bind().dialect.name, ()):
        op.execute(statement)


def downgrade() -> None:
    op.drop_table("journal")
    op.drop_table("attempts")
    op.drop_table("budget_periods")
    op.drop_table("budgets")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS budget_tasks_journal_append_only()")
