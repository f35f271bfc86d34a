"""The ledger's tables, as SQLAlchemy Core metadata.

This file and the alembic migrations under ``budget_tasks/migrations`` must give the
same database; ``tests/integration/test_migrations.py`` checks that they do.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    event,
    false,
    text,
)
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.types import TypeDecorator

from .functions import FUNCTIONS_DDL
from .partitions import FIXED_DDL
from .records import RATE_KINDS
from .states import ATTEMPT_REASONS, ATTEMPT_STATES, OPERATION_STATUSES

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING)


def _hot(target: str) -> ForeignKey:
    """A reference to a row every admission and settlement writes (a budget, its
    period), checked at COMMIT, not as each row is inserted. Checked at the INSERT,
    each check locks the referenced row FOR KEY SHARE before the transaction's own
    UPDATE of it, and the lockers of one hot row pile up into MultiXacts (about 9 per
    cycle); checked at COMMIT, the transaction already holds that row's update lock,
    and none is made. Migration 0010 (PostgreSQL)."""
    return ForeignKey(target, deferrable=True, initially="DEFERRED")


#: What the purge looks for, by table: the rows that still hold users' content. Each
#: is a partial index (migration 0011), so the hourly purge reads what is left to
#: purge, not the history.
PURGEABLE = {
    "operations": "result IS NOT NULL OR payload IS NOT NULL OR error IS NOT NULL",
    "waiting": "completed_at IS NULL AND payload IS NOT NULL",
    "side_effects": "result IS NOT NULL",
    "attempts": "note IS NOT NULL OR answer IS NOT NULL",
}


def _partial(name: str, column: str, where: str) -> Index:
    return Index(name, column, postgresql_where=text(where), sqlite_where=text(where))


JOURNAL_KINDS = (
    "hold", "release", "charge", "adjustment", "cap", "freeze", "unfreeze", "reopen",
    "grant", "return",
)  # fmt: skip
#: What an operator does to an operation (its events are kept as a record of it).
OPERATION_EVENT_KINDS = ("reopen",)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, on every backend."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are refused: the ledger keeps time in UTC")
        value = value.astimezone(UTC)
        # SQLite has no zone; store UTC wall time so that text ordering is time ordering.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets 64-bit ids.
Id = BigInteger().with_variant(Integer(), "sqlite")


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


budgets = Table(
    "budgets",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("name", String(200), nullable=False),
    Column("tenant", String(200), nullable=True),
    Column("parent_id", Id, ForeignKey("budgets.id"), nullable=True),
    Column("cap", BigInteger, nullable=False),
    Column("period", String(8), nullable=False),
    Column("renewal", String(16), nullable=False),
    Column("rollover_ceiling", BigInteger, nullable=True),
    Column("frozen", Boolean(create_constraint=False), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    # Added in migration 0013: a budget that admits against grants drawn from its
    # ancestors (escrow), chosen when it is made.
    Column("escrow", Boolean(create_constraint=False), nullable=False, server_default=false()),
    # Added in migration 0013: a budget split into ``slices`` rows (each an escrowed
    # budget of its own under it, ``slice_of`` naming their owner) that share its cap.
    Column("slices", Integer, nullable=False, server_default="1"),
    Column("slice_of", Id, ForeignKey("budgets.id"), nullable=True),
    # Added in migration 0023: the budget's weight in the rate windows its calls (and
    # those of the budgets under it that have none) share with other tenants' calls.
    Column("rate_weight", Integer, nullable=True),
    UniqueConstraint("name"),
    CheckConstraint("cap >= 0", name="cap_not_negative"),
    CheckConstraint(f"period IN ({_in(('none', 'day', 'week', 'month'))})", name="period_known"),
    CheckConstraint(f"renewal IN ({_in(('reset', 'rollover'))})", name="renewal_known"),
    CheckConstraint("rollover_ceiling IS NULL OR rollover_ceiling >= cap", name="ceiling_ge_cap"),
    CheckConstraint("parent_id IS NULL OR parent_id <> id", name="not_own_parent"),
    CheckConstraint("slices >= 1", name="slices_positive"),
    CheckConstraint(
        "rate_weight IS NULL OR (rate_weight >= 1 AND rate_weight <= 1000)",
        name="rate_weight_known",
    ),
)

budget_periods = Table(
    "budget_periods",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("budget_id", Id, ForeignKey("budgets.id"), nullable=False),
    Column("period_start", UTCDateTime, nullable=False),
    Column("cap", BigInteger, nullable=False),
    Column("spent", BigInteger, nullable=False),
    Column("held", BigInteger, nullable=False),
    Column("opened_at", UTCDateTime, nullable=False),
    # Added in migration 0005: a period closes (admits nothing more) before the next one
    # carries what it left unused; ``carried_out`` is what it gave the next period.
    Column("closed_at", UTCDateTime, nullable=True),
    Column("carried_out", BigInteger, nullable=False, server_default="0"),
    # Added in migration 0006: what settlements charged above their reservations, by
    # whoever settled (a task, reconciliation, an operator); derived from the journal.
    Column("overrun", BigInteger, nullable=False, server_default="0"),
    # Added in migration 0013 (escrow): ``drawn`` is what this period holds as grants
    # from its ancestors' periods and has not returned; ``granted`` what it has granted
    # to escrowed budgets below it and not had back (counted against its cap like a
    # hold); ``drawn_at`` when it last drew.
    Column("drawn", BigInteger, nullable=False, server_default="0"),
    Column("granted", BigInteger, nullable=False, server_default="0"),
    Column("drawn_at", UTCDateTime, nullable=True),
    UniqueConstraint("budget_id", "period_start"),
    # Added in migration 0012: the report (the metrics scrape, `status`) reads each
    # budget's current period by its start, and opening a period closes the open ones
    # before it: one row per budget each, not its history.
    Index(None, "period_start"),
    _partial("ix_budget_periods_open", "budget_id", "closed_at IS NULL"),
    # Added in migration 0015: the periods holding a grant (beat's return of idle grants).
    _partial("ix_budget_periods_drawn", "id", "drawn > 0"),
    # Added in migration 0018: the periods charged above their reservations (few), which
    # the report rolls up into their ancestors' overrun.
    _partial("ix_budget_periods_overrun", "period_start", "overrun > 0"),
    CheckConstraint("cap >= 0", name="cap_not_negative"),
    CheckConstraint("held >= 0", name="held_not_negative"),
    CheckConstraint("spent >= 0", name="spent_not_negative"),
    CheckConstraint("drawn >= 0", name="drawn_not_negative"),
    CheckConstraint("granted >= 0", name="granted_not_negative"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("key", String(255), nullable=False),
    Column("budget_id", Id, _hot("budgets.id"), nullable=False),
    Column("period_id", Id, _hot("budget_periods.id"), nullable=False),
    Column("fingerprint", String(255), nullable=True),
    Column("reason", String(32), nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("actual", BigInteger, nullable=True),
    Column("state", String(16), nullable=False),
    Column("provider", String(64), nullable=True),
    Column("request_id", String(255), nullable=True),
    Column("note", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("sending_at", UTCDateTime, nullable=True),
    Column("resolved_at", UTCDateTime, nullable=True),
    # Added in migration 0002: the price table the estimate came from.
    Column("price_version", String(64), nullable=True),
    # Added in migration 0003: the operation the attempt serves, the label of a call
    # within it (None for the operation's main call), and whether the charge is the
    # estimate because the run reported no usage.
    Column("operation_id", Id, ForeignKey("operations.id"), nullable=True),
    Column("label", String(100), nullable=True),
    Column(
        "estimate_only", Boolean(create_constraint=False), nullable=False, server_default=false()
    ),
    # Added in migration 0004: what reconciliation needs (which lookup, the model to
    # price with, the provider's response id), its backoff, and the stale-hold flag.
    Column("lookup", String(32), nullable=True),
    Column("model", String(100), nullable=True),
    Column("response_id", String(255), nullable=True),
    Column("lookups", Integer, nullable=False, server_default="0"),
    Column("next_lookup_at", UTCDateTime, nullable=True),
    Column("flagged_at", UTCDateTime, nullable=True),
    # Added in migration 0005: a labelled call's position (its first attempt's key; a
    # later attempt of the same call shares it), the usage a run recorded (proof of
    # billing: never released below it), the answer a reconciliation found (for the
    # operation to adopt), and the client timeout the call was sent with.
    Column("step", String(255), nullable=True),
    Column("recorded_actual", BigInteger, nullable=True),
    Column("answer", Text, nullable=True),
    Column("timeout_ms", BigInteger, nullable=True),
    # Added in migration 0007: the digest of the request the attempt sent; an answer
    # reconciliation finds is adopted only for the same request.
    Column("request_digest", String(64), nullable=True),
    # Added in migration 0009: the most tokens the request allowed (input however
    # billed, output with reasoning), which the usage of its answer is vetted against.
    Column("input_bound", BigInteger, nullable=True),
    Column("output_bound", BigInteger, nullable=True),
    # Added in migration 0020: what its answer said it used (every input token however
    # billed; output with reasoning), the model that answered, and the hint of the API
    # key it was sent with (never the key): the drift check compares them with the
    # vendors' reports.
    Column("input_tokens", BigInteger, nullable=True),
    Column("output_tokens", BigInteger, nullable=True),
    Column("credential", String(64), nullable=True),
    Column("answered_by", String(100), nullable=True),
    UniqueConstraint("key"),
    CheckConstraint("amount >= 0", name="amount_not_negative"),
    CheckConstraint("actual IS NULL OR actual >= 0", name="actual_not_negative"),
    CheckConstraint(f"state IN ({_in(ATTEMPT_STATES)})", name="state_known"),
    CheckConstraint(f"reason IN ({_in(ATTEMPT_REASONS)})", name="reason_known"),
    CheckConstraint(
        "(state IN ('settled', 'released')) = (actual IS NOT NULL)", name="actual_iff_resolved"
    ),
    Index(None, "state", "created_at"),
    Index(None, "operation_id"),
    # Added in migration 0015: retention finds an archived month's attempts by period.
    Index(None, "period_id"),
    # Added in migration 0015: the attempts that may be orphans, in id order (beat's
    # adoption), without reading the settled history.
    _partial("ix_attempts_unsettled", "id", "state IN ('reserved', 'sending')"),
    # Added in migration 0011
    _partial("ix_attempts_purgeable", "resolved_at", PURGEABLE["attempts"]),
)

# One business intent (a task's idempotency key), its stored outcome and its lease.
operations = Table(
    "operations",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("key", String(255), nullable=False),
    Column("fingerprint", String(255), nullable=False),
    Column("task", String(255), nullable=True),
    Column("status", String(16), nullable=False),
    Column("result", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("lease_owner", String(255), nullable=True),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    Column("runs", Integer, nullable=False),
    Column("deliveries", Integer, nullable=False),
    Column("replays", Integer, nullable=False),
    Column("next_reason", String(32), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("completed_at", UTCDateTime, nullable=True),
    # Added in migration 0004: the task and arguments, to enqueue it again.
    Column("payload", Text, nullable=True),
    UniqueConstraint("key"),
    CheckConstraint(f"status IN ({_in(OPERATION_STATUSES)})", name="status_known"),
    # Added in migration 0015: retention finds finished operations past its window.
    Index(None, "completed_at"),
    # Added in migration 0011
    _partial("ix_operations_purgeable", "completed_at", PURGEABLE["operations"]),
    _partial("ix_operations_waiting_payload", "updated_at", PURGEABLE["waiting"]),
    # Added in migration 0015: the running operations (beat's adoption of what dead runs
    # left), without reading the finished history.
    _partial("ix_operations_running", "lease_expires_at", "status = 'running'"),
)

# Side effects run at most once per operation (BudgetTask.once), and the stored results
# of an operation's labelled calls (BudgetTask.spend).
side_effects = Table(
    "side_effects",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("operation_id", Id, ForeignKey("operations.id"), nullable=False),
    Column("name", String(255), nullable=False),
    Column("state", String(16), nullable=False),
    Column("result", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("completed_at", UTCDateTime, nullable=True),
    UniqueConstraint("operation_id", "name"),
    CheckConstraint("state IN ('started', 'done')", name="state_known"),
    # Added in migration 0011
    _partial("ix_side_effects_purgeable", "completed_at", PURGEABLE["side_effects"]),
)

# Added in migration 0008: what operators did to an operation (reopening a failed one),
# with who and why; money moves stay in the journal.
operation_events = Table(
    "operation_events",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("operation_id", Id, ForeignKey("operations.id"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("from_status", String(16), nullable=False),
    Column("to_status", String(16), nullable=False),
    Column("by", String(100), nullable=False),
    Column("note", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    CheckConstraint(f"kind IN ({_in(OPERATION_EVENT_KINDS)})", name="kind_known"),
    Index(None, "operation_id"),
)

journal = Table(
    "journal",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    # Migration 0006: no attempt for a change of cap (kind 'cap', its cap_delta).
    Column("attempt_id", Id, ForeignKey("attempts.id"), nullable=True),
    Column("period_id", Id, _hot("budget_periods.id"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("held_delta", BigInteger, nullable=False),
    Column("spent_delta", BigInteger, nullable=False),
    Column("note", Text, nullable=True),
    Column("ref", String(255), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("cap_delta", BigInteger, nullable=False, server_default="0"),
    # Added in migration 0009: who acted, for an operator's action (None: a run or beat).
    Column("actor", String(255), nullable=True),
    # Added in migration 0013: a grant or its return, in the period that drew it
    # (``drawn_delta``) and in each ancestor's period that granted it (``granted_delta``).
    Column("drawn_delta", BigInteger, nullable=False, server_default="0"),
    Column("granted_delta", BigInteger, nullable=False, server_default="0"),
    # Added in migration 0015: the start of the row's period, which the journal is
    # partitioned by on PostgreSQL (see :mod:`.partitions`); it is part of the primary
    # key there, as PostgreSQL requires of a partitioned table's keys.
    Column("period_start", UTCDateTime, nullable=False),
    CheckConstraint(f"kind IN ({_in(JOURNAL_KINDS)})", name="kind_known"),
    Index(None, "attempt_id"),
    Index(None, "period_id"),
    postgresql_partition_by="RANGE (period_start)",
    info={"partition_key": "period_start"},
)


def _journal_sums() -> list[Column[int]]:
    """A period's journal sums, as the audit derives its counters from them."""
    return [
        Column(name, BigInteger, nullable=False)
        for name in ("held", "spent", "overrun", "drawn", "granted")
    ]


# Added in migration 0014: what the last audit proved, so that the next one reads only
# the journal rows after it. ``audit_checkpoints`` holds each period's journal sums up
# to ``audit_position.journal_id``; every journal row up to that id had committed when
# it was read (the audit waited for the journal's writers under a SHARE lock).
audit_checkpoints = Table(
    "audit_checkpoints",
    metadata,
    Column("period_id", Id, ForeignKey("budget_periods.id"), primary_key=True),
    *_journal_sums(),
)

audit_position = Table(
    "audit_position",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("journal_id", BigInteger, nullable=False),
    Column("audited_at", UTCDateTime, nullable=False),
    CheckConstraint("id = 1", name="one_row"),
)

# Added in migration 0017 (PostgreSQL): what the audit proved of each journal partition,
# its lowest and its highest journal row (id and period start, the row's key) and how
# many rows, so that each audit finds by key, without reading the history, that every
# partition it proved still holds them: a partition emptied or detached behind the
# journal's triggers is found. A month retention archived (``archives``) is gone by
# design.
audit_partitions = Table(
    "audit_partitions",
    metadata,
    Column("partition", String(63), primary_key=True),
    Column("low_id", BigInteger, nullable=False),
    Column("low_start", UTCDateTime, nullable=False),
    Column("high_id", BigInteger, nullable=False),
    Column("high_start", UTCDateTime, nullable=False),
    Column("journal_rows", BigInteger, nullable=False),
)

# Added in migration 0015 (retention, PostgreSQL): what each archived month removed. A
# month's journal partition leaves by DETACH once its periods are closed, settled and
# audited: ``kept_as`` names the directory it was exported to, or the detached table
# that still holds it. ``archived_periods`` keeps each of its periods' journal sums, which
# a full audit starts from (the incremental one has them in its checkpoints already).
archives = Table(
    "archives",
    metadata,
    Column("partition", String(63), primary_key=True),
    Column("month", UTCDateTime, nullable=False),
    Column("journal_rows", BigInteger, nullable=False),
    Column("periods", BigInteger, nullable=False),
    Column("kept_as", Text, nullable=False),
    Column("archived_at", UTCDateTime, nullable=False),
)

archived_periods = Table(
    "archived_periods",
    metadata,
    Column("period_id", Id, ForeignKey("budget_periods.id"), primary_key=True),
    Column("partition", String(63), ForeignKey("archives.partition"), nullable=False),
    *_journal_sums(),
)

#: How far a rate window may owe: two days of its limit, in thousandths (``level >=
#: -per_minute * RATE_MOST_OWED``): a line of calls booked ahead (a day at most) and
#: what a provider's 429 puts on top.
RATE_MOST_OWED = 2880 * 1000

# Added in migration 0021: a provider's rate limit held across the fleet, one token
# bucket per provider, scope (a model, a group of models, an API key) and kind. Its
# level is in thousandths of a unit, refilled continuously at ``per_minute`` a minute
# as of ``refilled_ms`` (milliseconds since the epoch, by the ledger's clock).
rate_windows = Table(
    "rate_windows",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("provider", String(64), nullable=False),
    Column("scope", String(100), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("per_minute", BigInteger, nullable=False),
    Column("level", BigInteger, nullable=False),
    Column("refilled_ms", BigInteger, nullable=False),
    # Added in migration 0023: the window's line of calls waiting their turn. What they
    # booked (in thousandths; the level already owes it), the line's virtual time (the
    # place of the last booking sent), and how many calls have joined it.
    Column("booked", BigInteger, nullable=False, server_default="0"),
    Column("vtime", BigInteger, nullable=False, server_default="0"),
    Column("arrivals", BigInteger, nullable=False, server_default="0"),
    UniqueConstraint("provider", "scope", "kind"),
    CheckConstraint("per_minute > 0", name="per_minute_positive"),
    # below 0 by what is booked ahead (migration 0022) and by a 429's retry-after;
    # at most two days of the limit (migration 0023)
    CheckConstraint(f"level >= -per_minute * {RATE_MOST_OWED}", name="owed_within_two_days"),
    CheckConstraint("booked >= 0", name="booked_not_negative"),
    CheckConstraint(f"kind IN ({_in(RATE_KINDS)})", name="kind_known"),
)

# Added in migration 0022: what each call took from each rate window (``taken``, in
# units), kept until its settlement gives back what it did not use; and, with a
# ``back_ms`` (migration 0023), a call waiting its turn in the window's line: its place
# (``tag``, the line's virtual time where it stands, then ``arrival``) and when it was
# told to come back. It sends at its turn, under the same key, without taking again.
rate_takes = Table(
    "rate_takes",
    metadata,
    Column("key", String(255), primary_key=True),
    Column("window_id", Id, primary_key=True),
    Column("taken", BigInteger, nullable=False),
    Column("back_ms", BigInteger, nullable=True),
    # the window is the call's own model's: a limit the provider states lowers it
    Column("own", Boolean, nullable=False),
    Column("tag", BigInteger, nullable=True),
    Column("arrival", BigInteger, nullable=True),
    CheckConstraint("taken >= 0", name="taken_not_negative"),
)
# a window's line, in the order its calls have their turns
Index("ix_rate_takes_line", rate_takes.c.window_id, rate_takes.c.tag, rate_takes.c.arrival)

# Added in migration 0023: where each tenant (a budget: see ``budgets.rate_weight``)
# stands in a window's line: the virtual time its last booking there ends. A tenant's
# next booking starts there, or at the line's present if that is later.
rate_shares = Table(
    "rate_shares",
    metadata,
    Column("window_id", Id, primary_key=True),
    Column("share", Id, primary_key=True),
    Column("finish", BigInteger, nullable=False),
)

# Added in migration 0007: this ledger's own id, made once when its tables are made.
# What the provider is sent as a call's key (Idempotency-Key, stored metadata) is a
# digest of it and the attempt key: two ledgers sharing an API key (staging and
# production) never find, charge or replay each other's calls.
installation = Table(
    "installation",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("installation_id", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    CheckConstraint("id = 1", name="one_row"),
)


def new_installation_id() -> str:
    return uuid.uuid4().hex


@event.listens_for(installation, "after_create")
def _installation_row(target: Table, connection: Connection, **kw: Any) -> None:
    connection.execute(
        target.insert().values(
            id=1, installation_id=new_installation_id(), created_at=datetime.now(UTC)
        )
    )


# The journal is append-only in the database itself, not only by convention.
APPEND_ONLY_DDL: dict[str, tuple[str, ...]] = {
    "postgresql": (
        """CREATE OR REPLACE FUNCTION budget_tasks_journal_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        MESSAGE = 'the budget-tasks journal is append-only (' || TG_OP || ' refused)';
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


#: Added in migration 0006: TRUNCATE fires no row trigger, so it has its own. It is on
#: the partitioned journal alone; each partition has its own (``FIXED_DDL`` and
#: :func:`.partitions.make_months` make them, migration 0017 on existing partitions).
NO_TRUNCATE_DDL = """CREATE TRIGGER journal_no_truncate BEFORE TRUNCATE ON journal
FOR EACH STATEMENT EXECUTE FUNCTION budget_tasks_journal_append_only()"""


@event.listens_for(journal, "after_create")
def _journal_append_only(target: Table, connection: Connection, **kw: Any) -> None:
    statements = list(APPEND_ONLY_DDL.get(connection.dialect.name, ()))
    if connection.dialect.name == "postgresql":
        statements.append(NO_TRUNCATE_DDL)
        statements.extend(FIXED_DDL)
        # admission and settlement as one statement each (see .functions)
        statements.extend(FUNCTIONS_DDL)
    for statement in statements:
        connection.execute(DDL(statement))  # type: ignore[no-untyped-call]


@compiles(PrimaryKeyConstraint, "postgresql")
def _partitioned_key(constraint: PrimaryKeyConstraint, compiler: Any, **kw: Any) -> str:
    """A partitioned table's primary key holds its partition key (PostgreSQL requires
    it); elsewhere the key is the id alone (SQLite's INTEGER PRIMARY KEY is its rowid)."""
    table = constraint.table
    extra = table.info.get("partition_key")
    if extra is None:
        return str(compiler.visit_primary_key_constraint(constraint, **kw))
    columns = ", ".join(compiler.preparer.quote(c.name) for c in constraint.columns)
    name = compiler.preparer.format_constraint(constraint)
    return f"CONSTRAINT {name} PRIMARY KEY ({columns}, {compiler.preparer.quote(extra)})"
