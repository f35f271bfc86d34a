"""The journal's partitions on PostgreSQL: one per calendar month of the periods its rows
belong to (``journal.period_start``), so that a month whose periods are closed, settled
and audited leaves the database whole, by DETACH, never by DELETE (which the journal
refuses).

Every journal row of a period is in the partition of its period's start, so one month's
partition holds the whole history of the periods that began in it. Budgets without a
period (their one period starts at the epoch and never closes) keep their rows in
``journal_none``; a row whose month has no partition yet lands in ``journal_default``,
and retention never touches either. The beat job that renews periods makes the months
ahead of need (:data:`AHEAD`); two beats that race make each month once.

Each partition refuses TRUNCATE as the journal does (:func:`no_truncate_ddl`): the
journal's row triggers are cloned to its partitions, but a statement trigger such as
TRUNCATE's is not, and a partition can be named in a TRUNCATE of its own. Retention's
DETACH and DROP of an archived month are not refused.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from .periods import next_period_start, period_start

if TYPE_CHECKING:
    from .driver import Cursor

log = logging.getLogger("budget_tasks.ledger")

NONE_PARTITION = "journal_none"
DEFAULT_PARTITION = "journal_default"
#: Months made ahead of the current one.
AHEAD = 3
#: The advisory lock that lets one beat at a time make partitions.
LOCK_KEY = 0x6274_7061  # "btpa"

_MONTH = re.compile(r"^journal_y(\d{4})m(\d{2})$")

#: The name of the journal's TRUNCATE guard, on the journal and on each partition.
NO_TRUNCATE = "journal_no_truncate"


def no_truncate_ddl(name: str) -> str:
    """The TRUNCATE guard of partition ``name``, made with it (the journal's own is
    on the partitioned table alone: PostgreSQL clones row triggers to partitions, not
    statement triggers). It runs the journal's append-only function (migration 0001)."""
    return (
        f"CREATE TRIGGER {NO_TRUNCATE} BEFORE TRUNCATE ON {name} "
        "FOR EACH STATEMENT EXECUTE FUNCTION budget_tasks_journal_append_only()"
    )


#: The two partitions every partitioned journal has, made with it, and their guards.
FIXED_DDL = (
    f"CREATE TABLE IF NOT EXISTS {NONE_PARTITION} PARTITION OF journal "
    "FOR VALUES FROM (MINVALUE) TO ('1970-01-02 00:00:00+00')",
    no_truncate_ddl(NONE_PARTITION),
    f"CREATE TABLE IF NOT EXISTS {DEFAULT_PARTITION} PARTITION OF journal DEFAULT",
    no_truncate_ddl(DEFAULT_PARTITION),
)

PARTITIONS = """
SELECT c.relname, CAST(c.reltuples AS BIGINT), pg_total_relation_size(c.oid)
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = CAST('journal' AS regclass)
ORDER BY c.relname"""

_IN_DEFAULT = f"""
SELECT 1 FROM {DEFAULT_PARTITION}
WHERE period_start >= :start AND period_start < :end LIMIT 1"""


def month_start(at: datetime) -> datetime:
    """The start (UTC) of the calendar month that contains ``at``."""
    return period_start("month", at)


def next_month(start: datetime) -> datetime:
    after = next_period_start("month", start)
    assert after is not None  # only a period of kind "none" has no next
    return after


def name_of(start: datetime) -> str:
    """The partition of the month that starts at ``start``."""
    return f"journal_y{start.year:04d}m{start.month:02d}"


def month_of(name: str) -> datetime | None:
    """The start of the month partition ``name`` holds (None: not a month partition)."""
    found = _MONTH.match(name)
    if found is None:
        return None
    return datetime(int(found[1]), int(found[2]), 1, tzinfo=UTC)


def is_partition(name: str | None) -> bool:
    """Whether ``name`` is one of the journal's partitions."""
    return name in (NONE_PARTITION, DEFAULT_PARTITION) or month_of(name or "") is not None


def month_ddl(start: datetime) -> str:
    # Partition bounds cannot be bind parameters; these come from our own datetimes.
    end = next_month(start)
    return (
        f"CREATE TABLE IF NOT EXISTS {name_of(start)} PARTITION OF journal "
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )


def make_months(cur: Cursor, first: datetime, last: datetime) -> list[str]:
    """Make the month partitions from ``first``'s month to ``last``'s, those missing,
    each with its TRUNCATE guard; the names made. A month that already has rows in the
    default partition is left there (PostgreSQL refuses the new partition) and said in
    the log."""
    cur.run("SELECT pg_advisory_xact_lock(:key)", {"key": LOCK_KEY})
    existing = {row[0] for row in cur.all(PARTITIONS, {})}
    made: list[str] = []
    start, last = month_start(first), month_start(last)
    while start <= last:
        name = name_of(start)
        if name not in existing:
            end = next_month(start)
            if cur.one(_IN_DEFAULT, {"start": start, "end": end}) is not None:
                log.warning(
                    "journal rows of %s are in %s (its month had no partition when they "
                    "were written): that month stays there, and retention keeps it",
                    start.strftime("%Y-%m"),
                    DEFAULT_PARTITION,
                )
            else:
                cur.ddl(month_ddl(start))
                cur.ddl(no_truncate_ddl(name))
                made.append(name)
        start = next_month(start)
    return made


def ahead_of(now: datetime, months: int = AHEAD) -> datetime:
    """The start of the month ``months`` after ``now``'s."""
    start = month_start(now)
    for _ in range(months):
        start = next_month(start)
    return start
