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
from .base import LedgerBase
from .driver import Cursor
from .partitions import month_of
from .records import AuditFinding

COUNTERS = ("held", "spent", "overrun", "drawn", "granted")

log = logging.getLogger("budget_tasks.ledger")


class Audits(LedgerBase):
    """The audit methods of :class:`~budget_tasks.Ledger`."""

    def audit(self, *, full: bool = False) -> list[AuditFinding]:
        """Budget periods whose counters differ from their journal; empty when sound.

        Proves the open periods and every period with journal rows since the last
        audit (the first audit, and ``full=True``, read the whole journal and prove
        every period). A closed period changed behind the journal with no journal row
        since is found by a full audit. On PostgreSQL, a journal partition that lost
        rows the audit proved is found by every audit (counter ``rows``, the budget
        named by the partition)."""
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            if not self._driver.sqlite:
                cur.run(sql.LOCK_JOURNAL, {})
            (upto,) = cur.one(sql.JOURNAL_END, {}) or (0,)
        with self._driver.transaction() as cur:
            cur.run(sql.MAKE_AUDIT_POSITION, {"now": stamp})
            (since,) = cur.one(sql.LOCK_AUDIT_POSITION, {}) or (0,)
            since = int(since)
            first = full or since == 0
            partitioned = not self._driver.sqlite and self._keeps_partitions(cur)
            # before this audit records anything: what earlier ones proved is still there
            lost = self._lost_partitions(cur) if partitioned else []
            if first:
                cur.run(sql.FORGET_CHECKPOINTS, {})
                cur.run(sql.SEED_CHECKPOINTS, {})
                since = 0
            rows = cur.all(sql.AUDIT_ALL_PERIODS if full else sql.AUDIT_PERIODS, {"since": since})
            # another audit may have moved on meanwhile: never move the position back
            upto = max(int(upto), since)
            span = {"since": since, "upto": upto}
            cur.run(sql.ADVANCE_CHECKPOINTS, span)
            if partitioned:
                cur.run(sql.RECORD_ALL_PARTITIONS if first else sql.RECORD_PARTITIONS, span)
            cur.run(sql.SET_AUDIT_POSITION, {"upto": upto, "now": stamp})
        findings = []
        for name, start, *pairs in rows:
            for i, counter in enumerate(COUNTERS):
                recorded, derived = int(pairs[2 * i]), int(pairs[2 * i + 1])
                if recorded != derived:
                    findings.append(
                        AuditFinding(name, self._driver.from_ts(start), counter, recorded, derived)
                    )
        return findings + lost

    def _keeps_partitions(self, cur: Cursor) -> bool:
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

    def _lost_partitions(self, cur: Cursor) -> list[AuditFinding]:
        """The journal partitions that no longer hold the rows earlier audits proved
        in them (PostgreSQL): each as a finding of counter ``rows``, what the audits
        proved against what is left of it."""
        found = []
        for partition, low_id, low_start, high_id, proved in cur.all(sql.LOST_PARTITIONS, {}):
            params: dict[str, Any] = {"partition": partition, "low_id": low_id, "high_id": high_id}
            (left,) = cur.one(sql.PARTITION_ROWS_LEFT, params) or (0,)
            start = month_of(partition) or self._driver.from_ts(low_start)
            found.append(AuditFinding(partition, start, "rows", int(proved), int(left)))
        return found

    def audit_size(self, *, full: bool = False) -> int:
        """How many journal rows the next audit reads (a full one: PostgreSQL's
        estimate, where it has one)."""
        with self._driver.transaction() as cur:
            if full:
                if not self._driver.sqlite:
                    (estimate,) = cur.one(sql.JOURNAL_ROWS_ESTIMATE, {}) or (-1,)
                    if int(estimate) >= 0:
                        return int(estimate)
                (count,) = cur.one(sql.JOURNAL_ROWS, {}) or (0,)
                return int(count)
            row = cur.one(sql.AUDIT_SINCE, {})
            since = 0 if row is None else int(row[0])
            (count,) = cur.one(sql.JOURNAL_ROWS_AFTER, {"since": since}) or (0,)
            return int(count)
