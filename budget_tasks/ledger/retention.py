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

from ..errors import RetentionRefused
from . import partitions
from . import statements as sql
from .driver import DEADLOCK, LOCK_NOT_AVAILABLE, Cursor
from .store import Store

#: The shortest retention window: a redelivery, a duplicate enqueue or a reconciliation
#: later than the window finds no operation to replay, so it must outlast them all.
MIN_KEEP = timedelta(days=1)
#: How long one try of the detach waits for the ledger's writers (under the server's
#: deadlock_timeout, 1 s by default, so that where a writer and the detach wait on
#: each other the detach gives up, not the writer), and how many tries it makes.
DETACH_WAIT = "500ms"
DETACH_TRIES = 10


def postgresql_only(store: Store) -> None:
    if store.driver.sqlite:
        raise RetentionRefused("retention needs PostgreSQL; SQLite keeps every row")


def archive_month(store: Store, month: datetime, root: Path, now: datetime) -> tuple[str, ...]:
    """Archive one month in one transaction; what blocks it (nothing: done)."""
    name = partitions.name_of(month)
    span = {"start": month, "end": partitions.next_month(month)}
    partial = root / f"{name}.partial"
    final = root / name
    try:
        with store.driver.transaction() as cur:
            cur.run(sql.LOCK_MONTH_PERIODS, span)
            reasons = blockers(cur, month)
            if reasons:
                return reasons
            stamp = store.driver.ts(now)
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


def remove_operations(store: Store, params: dict[str, Any], into: Path) -> int:
    """Finished operations past the window that no attempt names, with their side
    effects and events (those go first: they name the operation), a batch at a
    time, each committed and appended to ``into``/<table>.csv first."""
    done = 0
    while True:
        with store.driver.transaction() as cur:
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


def blockers(cur: Cursor, month: datetime) -> tuple[str, ...]:
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
