"""The audit: every period's counters proved from the append-only journal.

An audit reads only what changed since the last one: the journal rows after the
position it reached (by id, the primary key), added to the sums it proved then, for
the open periods and the periods those rows touch. A full audit reads the whole
journal and proves every period again. The position only moves to an id that every
journal writer before it has passed (PostgreSQL: under a SHARE lock on the journal,
held for one read, that waits for the writers in flight), so a row committed late
with a lower id is never skipped. The journal rows that retention archived are in the
checkpoints already (retention adds them as it removes them), and a full audit starts
from their sums, which retention kept (``archived_periods``).

Reading only what came after its position, an audit would not see a journal partition
that lost rows before it (emptied with its TRUNCATE guard off, or detached): its sums
stand in the checkpoints. So on PostgreSQL each audit also keeps, per partition, the
lowest and highest row it proved and how many (``audit_partitions``), and looks both
up by key each time: a partition that no longer holds them is a finding (counter
``rows``), unless retention archived it (``archives``).
"""

from __future__ import annotations

import logging
from typing import Any

from . import statements as sql
from .driver import Cursor
from .partitions import month_of
from .records import AuditFinding
from .store import Store

COUNTERS = ("held", "spent", "overrun", "drawn", "granted")

log = logging.getLogger("budget_tasks.ledger")


def keeps_partitions(store: Store, cur: Cursor) -> bool:
    """Whether the database has the table of what the audit proved of each
    partition (PostgreSQL, migration 0017); one not yet migrated is audited without
    it, and told so."""
    row = cur.one(sql.AUDIT_PARTITIONS_MADE, {})
    if row is not None and row[0]:
        return True
    log.warning(
        "the ledger's database predates migration 0017: the audit cannot tell a journal "
        "partition that lost rows; run `budget-tasks db upgrade`"
    )
    return False


def lost_partitions(store: Store, cur: Cursor) -> list[AuditFinding]:
    """The journal partitions that no longer hold the rows earlier audits proved
    in them (PostgreSQL): each as a finding of counter ``rows``, what the audits
    proved against what is left of it."""
    found = []
    for partition, low_id, low_start, high_id, proved in cur.all(sql.LOST_PARTITIONS, {}):
        params: dict[str, Any] = {"partition": partition, "low_id": low_id, "high_id": high_id}
        (left,) = cur.one(sql.PARTITION_ROWS_LEFT, params) or (0,)
        start = month_of(partition) or store.driver.from_ts(low_start)
        found.append(AuditFinding(partition, start, "rows", int(proved), int(left)))
    return found
