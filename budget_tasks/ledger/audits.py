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
"""

from __future__ import annotations

from . import statements as sql
from .base import LedgerBase
from .records import AuditFinding

COUNTERS = ("held", "spent", "overrun", "drawn", "granted")


class Audits(LedgerBase):
    """The audit methods of :class:`~budget_tasks.Ledger`."""

    def audit(self, *, full: bool = False) -> list[AuditFinding]:
        """Budget periods whose counters differ from their journal; empty when sound.

        Proves the open periods and every period with journal rows since the last
        audit (the first audit, and ``full=True``, read the whole journal and prove
        every period). A closed period changed behind the journal with no journal row
        since is found by a full audit."""
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            if not self._driver.sqlite:
                cur.run(sql.LOCK_JOURNAL, {})
            (upto,) = cur.one(sql.JOURNAL_END, {}) or (0,)
        with self._driver.transaction() as cur:
            cur.run(sql.MAKE_AUDIT_POSITION, {"now": stamp})
            (since,) = cur.one(sql.LOCK_AUDIT_POSITION, {}) or (0,)
            since = int(since)
            if full or since == 0:
                cur.run(sql.FORGET_CHECKPOINTS, {})
                cur.run(sql.SEED_CHECKPOINTS, {})
                since = 0
            rows = cur.all(sql.AUDIT_ALL_PERIODS if full else sql.AUDIT_PERIODS, {"since": since})
            # another audit may have moved on meanwhile: never move the position back
            upto = max(int(upto), since)
            cur.run(sql.ADVANCE_CHECKPOINTS, {"since": since, "upto": upto})
            cur.run(sql.SET_AUDIT_POSITION, {"upto": upto, "now": stamp})
        findings = []
        for name, start, *pairs in rows:
            for i, counter in enumerate(COUNTERS):
                recorded, derived = int(pairs[2 * i]), int(pairs[2 * i + 1])
                if recorded != derived:
                    findings.append(
                        AuditFinding(name, self._driver.from_ts(start), counter, recorded, derived)
                    )
        return findings

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
