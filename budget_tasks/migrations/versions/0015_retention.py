"""Retention: each journal row names its period's start, and on PostgreSQL the journal
is partitioned by it, one partition per month, so that a month whose periods are closed
and audited can leave by DETACH (the journal still refuses DELETE). ``archives`` and
``archived_periods`` record what left and the sums a full audit starts from; attempts
get an index by period and operations one by completion, which retention finds them
by, and two partial indexes keep beat's grant return and orphan adoption off the history.

On PostgreSQL the journal is rebuilt: its rows are copied, ids kept, into the
partitioned table (one partition per month that has periods, and the months ahead).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = sa.DateTime(timezone=True)
KINDS = (
    "kind IN ('hold', 'release', 'charge', 'adjustment', 'cap', 'freeze', 'unfreeze', "
    "'reopen', 'grant', 'return')"
)
#: Partial indexes that keep two beat jobs off the history: periods holding a grant,
#: attempts that may be orphans, running operations.
PARTIAL = (
    ("ix_budget_periods_drawn", "budget_periods", "id", "drawn > 0"),
    ("ix_attempts_unsettled", "attempts", "id", "state IN ('reserved', 'sending')"),
    ("ix_operations_running", "operations", "lease_expires_at", "status = 'running'"),
)
COLUMNS = (
    "id, attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at, "
    "cap_delta, actor, drawn_delta, granted_delta"
)

#: The journal's append-only triggers on PostgreSQL (schema.APPEND_ONLY_DDL and
#: NO_TRUNCATE_DDL as of this revision): the function's message is worded without a
#: format string since 0003's code, and is replaced here.
APPEND_ONLY_DDL = (
    """CREATE OR REPLACE FUNCTION budget_tasks_journal_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        MESSAGE = 'the budget-tasks journal is append-only (' || TG_OP || ' refused)';
END
$$""",
    """CREATE TRIGGER journal_append_only BEFORE UPDATE OR DELETE ON journal
FOR EACH ROW EXECUTE FUNCTION budget_tasks_journal_append_only()""",
    """CREATE TRIGGER journal_no_truncate BEFORE TRUNCATE ON journal
FOR EACH STATEMENT EXECUTE FUNCTION budget_tasks_journal_append_only()""",
)
#: The journal's append-only triggers on SQLite (as 0001 made them).
SQLITE_APPEND_ONLY = (
    """CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
    """CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
BEGIN SELECT RAISE(ABORT, 'the budget-tasks journal is append-only'); END""",
)

# The journal's partitions as this revision made them (budget_tasks.ledger.partitions
# as of this revision): the two every partitioned journal has, and one a month.

#: Months made ahead of the current one.
AHEAD = 3
FIXED_DDL = (
    "CREATE TABLE IF NOT EXISTS journal_none PARTITION OF journal "
    "FOR VALUES FROM (MINVALUE) TO ('1970-01-02 00:00:00+00')",
    "CREATE TABLE IF NOT EXISTS journal_default PARTITION OF journal DEFAULT",
)


def _month_start(at: datetime) -> datetime:
    """The start (UTC) of the calendar month that contains ``at``."""
    at = at.astimezone(UTC)
    return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _next_month(start: datetime) -> datetime:
    if start.month == 12:
        return start.replace(year=start.year + 1, month=1)
    return start.replace(month=start.month + 1)


def _month_ddl(start: datetime) -> str:
    end = _next_month(start)
    return (
        f"CREATE TABLE IF NOT EXISTS journal_y{start.year:04d}m{start.month:02d} "
        f"PARTITION OF journal FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )


def _ahead_of(now: datetime, months: int = AHEAD) -> datetime:
    """The start of the month ``months`` after ``now``'s."""
    start = _month_start(now)
    for _ in range(months):
        start = _next_month(start)
    return start


def _journal_columns(partitioned: bool) -> list[sa.Column[object]]:
    columns: list[sa.Column[object]] = [
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("attempt_id", Id, nullable=True),
        sa.Column("period_id", Id, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("held_delta", sa.BigInteger, nullable=False),
        sa.Column("spent_delta", sa.BigInteger, nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("ref", sa.String(255), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("cap_delta", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("actor", sa.String(255), nullable=True),
        sa.Column("drawn_delta", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("granted_delta", sa.BigInteger, nullable=False, server_default="0"),
    ]
    if partitioned:
        columns.append(sa.Column("period_start", When, nullable=False))
    return columns


def _journal_table(partitioned: bool) -> None:
    """The journal as of this revision (``partitioned``) or the one before, with its
    keys, indexes and append-only triggers."""
    key = ["id", "period_start"] if partitioned else ["id"]
    options = {"postgresql_partition_by": "RANGE (period_start)"} if partitioned else {}
    op.create_table(
        "journal",
        *_journal_columns(partitioned),
        sa.PrimaryKeyConstraint(*key, name=op.f("pk_journal")),
        sa.CheckConstraint(KINDS, name=op.f("ck_journal_kind_known")),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_journal_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(
            ["period_id"],
            ["budget_periods.id"],
            name=op.f("fk_journal_period_id_budget_periods"),
            deferrable=True,
            initially="DEFERRED",
        ),
        **options,  # type: ignore[arg-type]
    )
    op.create_index(op.f("ix_journal_attempt_id"), "journal", ["attempt_id"])
    op.create_index(op.f("ix_journal_period_id"), "journal", ["period_id"])
    for statement in APPEND_ONLY_DDL:
        op.execute(statement)


def _set_aside_journal() -> None:
    """Rename the journal and what bears its name, so a new one can take them."""
    op.execute("ALTER TABLE journal RENAME TO journal_old")
    op.execute("ALTER SEQUENCE journal_id_seq RENAME TO journal_old_id_seq")
    for index in ("pk_journal", "ix_journal_attempt_id", "ix_journal_period_id"):
        op.execute(f"ALTER INDEX {index} RENAME TO {index}_old")


def _upgrade_postgresql() -> None:
    bind = op.get_bind()
    _set_aside_journal()
    _journal_table(partitioned=True)
    for statement in FIXED_DDL:
        op.execute(statement)
    months = {
        _month_start(row[0].astimezone(UTC))
        for row in bind.exec_driver_sql(
            "SELECT DISTINCT period_start FROM budget_periods "
            "WHERE period_start >= '1970-01-02 00:00:00+00'"
        )
    }
    now = datetime.now(UTC)
    start = _month_start(now)
    while start <= _ahead_of(now):
        months.add(start)
        start = _next_month(start)
    for month in sorted(months):
        op.execute(_month_ddl(month))
    op.execute(
        f"INSERT INTO journal ({COLUMNS}, period_start) "
        f"SELECT {', '.join('j.' + c.strip() for c in COLUMNS.split(','))}, p.period_start "
        "FROM journal_old j JOIN budget_periods p ON p.id = j.period_id ORDER BY j.id"
    )
    op.execute(
        "SELECT setval('journal_id_seq', GREATEST((SELECT MAX(id) FROM journal_old), 1), "
        "(SELECT MAX(id) FROM journal_old) IS NOT NULL)"
    )
    op.execute("DROP TABLE journal_old")


def _upgrade_sqlite() -> None:
    with op.batch_alter_table("journal") as batch:
        batch.add_column(sa.Column("period_start", When, nullable=True))
    # The backfill is the one UPDATE the journal ever takes; its triggers come back after.
    op.execute("DROP TRIGGER IF EXISTS journal_no_update")
    op.execute("DROP TRIGGER IF EXISTS journal_no_delete")
    op.execute(
        "UPDATE journal SET period_start = "
        "(SELECT period_start FROM budget_periods WHERE budget_periods.id = journal.period_id)"
    )
    with op.batch_alter_table("journal", recreate="always") as batch:
        batch.alter_column("period_start", existing_type=When, nullable=False)
    for statement in SQLITE_APPEND_ONLY:
        op.execute(statement)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _upgrade_sqlite()
    else:
        _upgrade_postgresql()
    op.create_index(op.f("ix_attempts_period_id"), "attempts", ["period_id"])
    op.create_index(op.f("ix_operations_completed_at"), "operations", ["completed_at"])
    for name, table, column, where in PARTIAL:
        op.create_index(
            name, table, [column], postgresql_where=sa.text(where), sqlite_where=sa.text(where)
        )
    op.create_table(
        "archives",
        sa.Column("partition", sa.String(63), nullable=False),
        sa.Column("month", When, nullable=False),
        sa.Column("journal_rows", sa.BigInteger, nullable=False),
        sa.Column("periods", sa.BigInteger, nullable=False),
        sa.Column("kept_as", sa.Text, nullable=False),
        sa.Column("archived_at", When, nullable=False),
        sa.PrimaryKeyConstraint("partition", name=op.f("pk_archives")),
    )
    op.create_table(
        "archived_periods",
        sa.Column("period_id", Id, nullable=False),
        sa.Column("partition", sa.String(63), nullable=False),
        sa.Column("held", sa.BigInteger, nullable=False),
        sa.Column("spent", sa.BigInteger, nullable=False),
        sa.Column("overrun", sa.BigInteger, nullable=False),
        sa.Column("drawn", sa.BigInteger, nullable=False),
        sa.Column("granted", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("period_id", name=op.f("pk_archived_periods")),
        sa.ForeignKeyConstraint(
            ["period_id"],
            ["budget_periods.id"],
            name=op.f("fk_archived_periods_period_id_budget_periods"),
        ),
        sa.ForeignKeyConstraint(
            ["partition"],
            ["archives.partition"],
            name=op.f("fk_archived_periods_partition_archives"),
        ),
    )


def downgrade() -> None:
    # An archived month's rows are gone from the journal: the revision before this one
    # cannot prove those periods, so a downgrade over archives is refused.
    bind = op.get_bind()
    if bind.exec_driver_sql("SELECT 1 FROM archives LIMIT 1").first() is not None:
        raise RuntimeError("the ledger has archived months: 0015 cannot be downgraded")
    op.drop_table("archived_periods")
    op.drop_table("archives")
    for name, table, _, _ in PARTIAL:
        op.drop_index(name, table_name=table)
    op.drop_index(op.f("ix_operations_completed_at"), table_name="operations")
    op.drop_index(op.f("ix_attempts_period_id"), table_name="attempts")
    if bind.dialect.name == "sqlite":
        with op.batch_alter_table("journal", recreate="always") as batch:
            batch.drop_column("period_start")
        for statement in SQLITE_APPEND_ONLY:
            op.execute(statement)
        return
    _set_aside_journal()
    _journal_table(partitioned=False)
    op.execute(f"INSERT INTO journal ({COLUMNS}) SELECT {COLUMNS} FROM journal_old ORDER BY id")
    op.execute(
        "SELECT setval('journal_id_seq', GREATEST((SELECT MAX(id) FROM journal_old), 1), "
        "(SELECT MAX(id) FROM journal_old) IS NOT NULL)"
    )
    # The partitions go with their parent.
    op.execute("DROP TABLE journal_old CASCADE")
