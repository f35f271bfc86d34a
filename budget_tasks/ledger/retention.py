"""Retention (PostgreSQL): a month of the ledger leaves the database once nothing in it
can change, exported first, with the sums that later audits start from.

A month here is the journal partition of the periods that began in it (see
:mod:`.partitions`). It is archived only when it ended at least the retention window
ago, every one of its periods is closed, none holds money (no reserved, sending or
unknown attempt), no operation of its attempts is unfinished, and its journal proves
every one of its periods' counters. Then, in one transaction: its rows and its
attempts are written to a directory the operator chose (CSV, as ``COPY`` writes it,
with a manifest), each period's sums are kept (``archived_periods``) and added to the
audit's checkpoints, and the partition is detached and dropped. Its attempts, and
finished operations past the window that no attempt names any more, then go in
batches that each commit. Budget and period rows stay: they are each period's
statement.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from .. import _validate as check
from ..errors import RetentionRefused
from . import partitions
from . import statements as sql
from .base import LedgerBase
from .driver import DEADLOCK, LOCK_NOT_AVAILABLE, Cursor
from .records import PartitionInfo, Retained

#: The shortest retention window: a redelivery, a duplicate enqueue or a reconciliation
#: later than the window finds no operation to replay, so it must outlast them all.
MIN_KEEP = timedelta(days=1)
#: How long one try of the detach waits for the ledger's writers (under the server's
#: deadlock_timeout, 1 s by default, so that where a writer and the detach wait on
#: each other the detach gives up, not the writer), and how many tries it makes.
DETACH_WAIT = "500ms"
DETACH_TRIES = 10


class Retention(LedgerBase):
    """The retention methods of :class:`~budget_tasks.Ledger` (PostgreSQL)."""

    def _postgresql_only(self) -> None:
        if self._driver.sqlite:
            raise RetentionRefused("retention needs PostgreSQL; SQLite keeps every row")

    def make_partitions(self, *, ahead: int = partitions.AHEAD) -> list[str]:
        """Make the journal's month partitions from this month to ``ahead`` months
        on, those missing (PostgreSQL; SQLite has none): the names made."""
        check.positive(ahead + 1, "ahead")
        if self._driver.sqlite:
            return []
        now = self.now()
        with self._driver.transaction() as cur:
            return partitions.make_months(cur, now, partitions.ahead_of(now, ahead))

    def retention(self, keep: timedelta | None = None) -> list[PartitionInfo]:
        """Every journal partition and what a retention run with window ``keep``
        would do with it (None: no window, nothing is due), the archived months too."""
        self._postgresql_only()
        if keep is not None:
            check.duration(keep, "keep")
        now = self.now()
        current = partitions.month_start(now)
        cutoff = None if keep is None else partitions.month_start(now - keep)
        found: list[PartitionInfo] = []
        with self._driver.transaction() as cur:
            for name, rows, size in cur.all(partitions.PARTITIONS, {}):
                month = partitions.month_of(name)
                estimate = None if int(rows) < 0 else int(rows)
                blockers: tuple[str, ...] = ()
                if month is None:
                    state = "none" if name == partitions.NONE_PARTITION else "default"
                elif month > current:
                    state = "ahead"
                elif month == current:
                    state = "current"
                elif cutoff is None or partitions.next_month(month) > cutoff:
                    state = "kept"
                else:
                    blockers = _blockers(cur, month)
                    state = "blocked" if blockers else "due"
                found.append(PartitionInfo(name, month, state, estimate, int(size), blockers))
            for name, month, count, kept_as in cur.all(sql.ARCHIVES, {}):
                found.append(
                    PartitionInfo(
                        name, self._driver.from_ts(month), "archived", int(count), 0, (), kept_as
                    )
                )
        return sorted(found, key=lambda p: (p.month is not None, p.month or now, p.name))

    def retain(self, keep: timedelta, *, archive_to: str | Path, batch: int = 1_000) -> Retained:
        """Archive every month that ended at least ``keep`` ago and is settled (see
        the module) to a directory under ``archive_to``, then remove its attempts and
        the finished operations older than ``keep`` that no attempt names, in batches
        of ``batch`` rows. A month that is not settled is left, and said why."""
        self._postgresql_only()
        check.duration(keep, "keep")
        check.positive(batch, "batch")
        if keep < MIN_KEEP:
            raise RetentionRefused(f"a retention window under {MIN_KEEP} is refused: {keep}")
        root = Path(archive_to)
        if not root.is_dir():
            raise RetentionRefused(f"the archive directory {str(root)!r} does not exist")
        now = self.now()
        cutoff = partitions.month_start(now - keep)
        archived: list[str] = []
        blocked: dict[str, tuple[str, ...]] = {}
        with self._driver.transaction() as cur:
            months = [
                month
                for name, _, _ in cur.all(partitions.PARTITIONS, {})
                if (month := partitions.month_of(name)) is not None
                and partitions.next_month(month) <= cutoff
            ]
        for month in sorted(months):
            name = partitions.name_of(month)
            reasons = self._archive_month(month, root, now)
            if reasons:
                blocked[name] = reasons
            else:
                archived.append(name)
        params = {"batch": batch, "cutoff": self._driver.ts(now - keep)}
        # the attempts of archived periods: their month's export holds them
        attempts = self._in_batches(sql.RETAIN_ATTEMPTS, params)
        operations = self._remove_operations(params, root)
        return Retained(tuple(archived), blocked, attempts, operations)

    def _archive_month(self, month: datetime, root: Path, now: datetime) -> tuple[str, ...]:
        """Archive one month in one transaction; what blocks it (nothing: done)."""
        name = partitions.name_of(month)
        span = {"start": month, "end": partitions.next_month(month)}
        partial = root / f"{name}.partial"
        final = root / name
        try:
            with self._driver.transaction() as cur:
                cur.run(sql.LOCK_MONTH_PERIODS, span)
                reasons = _blockers(cur, month)
                if reasons:
                    return reasons
                stamp = self._driver.ts(now)
                cur.run(sql.MAKE_AUDIT_POSITION, {"now": stamp})
                (since,) = cur.one(sql.LOCK_AUDIT_POSITION, {}) or (0,)
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
                manifest = _export(cur, name, span, partial)
                cur.run(
                    sql.INSERT_ARCHIVE,
                    {
                        "partition": name,
                        "start": month,
                        "rows": manifest["journal_rows"],
                        "periods": manifest["periods"],
                        "kept_as": str(final),
                        "now": stamp,
                    },
                )
                cur.run(sql.ARCHIVE_PERIODS.format(partition=name), {"partition": name})
                cur.run(sql.CHECKPOINT_ARCHIVED.format(partition=name), {"since": int(since)})
                if not _detach(cur, name):
                    raise _Busy  # rolls the month's transaction back
                shutil.rmtree(final, ignore_errors=True)
                partial.rename(final)
        except _Busy:
            return (f"the ledger stayed busy for {DETACH_TRIES} tries: next run",)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return ()

    def _remove_operations(self, params: dict[str, Any], into: Path) -> int:
        """Finished operations past the window that no attempt names, with their side
        effects and events (those go first: they name the operation), a batch at a
        time, each committed and appended to ``into``/<table>.csv first."""
        done = 0
        while True:
            with self._driver.transaction() as cur:
                ids = [row[0] for row in cur.all(sql.RETAINABLE_OPERATIONS, params)]
                if ids:
                    for statement, table in (
                        (sql.RETAIN_OPERATION_EVENTS, "operation_events"),
                        (sql.RETAIN_SIDE_EFFECTS, "side_effects"),
                        (sql.RETAIN_OPERATIONS, "operations"),
                    ):
                        cur.run(statement, {"ids": ids})
                        rows = list(cur.raw.fetchall())
                        if rows:
                            _append(into / f"{table}.csv", cur, rows)
            done += len(ids)
            if len(ids) < params["batch"]:
                return done


class _Busy(Exception):
    """The detach found the ledger busy every try."""


def _detach(cur: Cursor, name: str) -> bool:
    """Detach and drop partition ``name`` (False: the ledger stayed busy).

    Dropping it drops its foreign keys, whose triggers live on ``attempts`` and
    ``budget_periods``: both are locked first, then the journal (by the DETACH), in
    one order, so that no writer holds one of them while it waits for another held
    here. The lock is held for the DETACH and the DROP, milliseconds; a try that waits
    longer than DETACH_WAIT rolls back to its savepoint and tries again."""
    for attempt in range(DETACH_TRIES):
        cur.ddl("SAVEPOINT detach")
        try:
            cur.ddl(f"SET LOCAL lock_timeout = '{DETACH_WAIT}'")
            cur.ddl("LOCK TABLE attempts, budget_periods IN ACCESS EXCLUSIVE MODE")
            cur.ddl(f"ALTER TABLE journal DETACH PARTITION {name}")
            cur.ddl(f"DROP TABLE {name}")
            cur.ddl("RELEASE SAVEPOINT detach")
            return True
        except cur.driver.unreachable as exc:
            if getattr(exc, "sqlstate", None) not in (LOCK_NOT_AVAILABLE, DEADLOCK):
                raise
            cur.ddl("ROLLBACK TO SAVEPOINT detach")
            time.sleep(0.1 * (attempt + 1))
    return False


def _blockers(cur: Cursor, month: datetime) -> tuple[str, ...]:
    """Why the month that starts at ``month`` cannot be archived (empty: it can)."""
    span = {"start": month, "end": partitions.next_month(month)}
    row = cur.one(sql.MONTH_BLOCKERS, span)
    assert row is not None
    open_periods, holding, unfinished, unsound = (int(v) for v in row)
    reasons = []
    if open_periods:
        reasons.append(f"{open_periods} open period(s)")
    if holding:
        reasons.append(f"{holding} attempt(s) still holding money")
    if unfinished:
        reasons.append(f"{unfinished} unfinished operation(s)")
    if unsound:
        reasons.append(f"{unsound} period(s) whose journal does not prove them: audit")
    return tuple(reasons)


def _export(cur: Cursor, name: str, span: dict[str, datetime], into: Path) -> dict[str, Any]:
    """Write the month's journal rows, periods and attempts to ``into`` (CSV with a
    header, as COPY writes it) and a manifest of counts and digests; the manifest."""
    manifest: dict[str, Any] = {"partition": name, "month": span["start"].isoformat()}
    queries = {
        "journal": sql.MONTH_JOURNAL_EXPORT.format(partition=name),
        "periods": sql.MONTH_PERIODS_EXPORT,
        "attempts": sql.MONTH_ATTEMPTS_EXPORT,
    }
    for table, query in queries.items():
        path = into / f"{table}.csv"
        digest = hashlib.sha256()
        statement = cur.driver.sql(f"COPY ({query}) TO STDOUT WITH (FORMAT csv, HEADER)")
        params = span if "%(" in statement else None
        with path.open("wb") as out, cur.raw.copy(statement, params) as copy:
            for chunk in copy:
                out.write(chunk)
                digest.update(chunk)
        lines = _count_rows(path)
        manifest[f"{table}_rows" if table != "periods" else "periods"] = lines
        manifest[f"{table}_sha256"] = digest.hexdigest()
    text = json.dumps(manifest, indent=2, sort_keys=True)
    (into / "MANIFEST.json").write_text(text + "\n", encoding="utf-8")
    return manifest


def _count_rows(path: Path) -> int:
    with path.open(newline="", encoding="utf-8") as f:
        return max(sum(1 for _ in csv.reader(f)) - 1, 0)


def _append(path: Path, cur: Cursor, rows: list[tuple[Any, ...]]) -> None:
    header = [column[0] for column in cur.raw.description or ()]
    new = not path.exists()
    with path.open("a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(header)
        writer.writerows(rows)
