"""Retention on PostgreSQL: the journal in month partitions, made ahead by beat (also
when two beats race, in two processes), and a month archived only when nothing in it
can change: never an open period, a hold, or an unfinished operation; after it, the
incremental and the full audit are clean and the archive holds every row that left."""

from __future__ import annotations

import csv
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from budget_tasks import Ledger, RetentionRefused
from budget_tasks.beat import renew_periods
from budget_tasks.errors import UnknownOperation
from budget_tasks.ledger.records import CallAsk, CallEnd
from budget_tasks.testing import ManualClock
from tests.support import race

from .test_cli import cli

JAN = datetime(2026, 1, 10, 12, tzinfo=UTC)
KEEP = timedelta(days=60)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(JAN)


@pytest.fixture
def ledger(pg_ledger: Ledger) -> Ledger:
    made = pg_ledger.upkeep.make_partitions(ahead=6)  # January to July
    assert "journal_y2026m01" in made or "journal_y2026m01" in _partitions(pg_ledger)
    return pg_ledger


def _partitions(ledger: Ledger) -> set[str]:
    with ledger.engine.connect() as conn:
        return set(
            conn.execute(
                text(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "WHERE i.inhparent = 'journal'::regclass"
                )
            ).scalars()
        )


def _count(ledger: Ledger, query: str) -> int:
    with ledger.engine.connect() as conn:
        return int(conn.execute(text(query)).scalar_one())


def spend(ledger: Ledger, budget: str, key: str, amount: int, actual: int) -> int:
    """An operation whose one call settled, finished: its id."""
    start = ledger.calls.admit(
        key, fingerprint="f", owner="me", lease=timedelta(minutes=5), max_runs=3
    )
    ledger.calls.reserve(budget, f"{key}#1", amount, operation_id=start.operation_id)
    ledger.calls.mark_sending(f"{key}#1")
    ledger.calls.settle(f"{key}#1", actual)
    ledger.calls.finish_operation(start.operation_id, result={"ok": key})
    return start.operation_id


def test_a_run_admitted_and_finished_in_one_commit_each_leaves_with_its_month(
    ledger: Ledger, clock: ManualClock, tmp_path: Path
) -> None:
    # the hot path (one admission, one finish: each the server function's call on
    # PostgreSQL) must leave its operation as retention finds every other
    ledger.create_budget("daily", 10_000, period="day")
    start = ledger.calls.admit(
        "one",
        fingerprint="f",
        owner="me",
        lease=timedelta(minutes=5),
        max_runs=3,
        call=CallAsk("daily", 100),
        plan=lambda here: ("one#1", "first"),
    )
    assert start.call is not None and start.call.reservation is not None
    end = ledger.calls.finish_operation(
        start.operation_id, result={"ok": 1}, call=CallEnd("one#1", "settle", 90), owner="me"
    )
    assert end.status == "succeeded"
    clock.advance(days=100)  # 20 April: January ended more than 60 days ago
    renew_periods(ledger)  # closes January's periods
    ran = ledger.upkeep.retain(KEEP, archive_to=tmp_path)
    assert ran.archived == ("journal_y2026m01",)
    assert (ran.attempts, ran.operations) == (1, 1)
    with pytest.raises(UnknownOperation):
        ledger.operation("one")
    assert ledger.audit(full=True) == []


def test_rows_go_to_their_periods_month_and_budgets_without_a_period_to_their_own(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("daily", 10_000, period="day")
    ledger.create_budget("forever", 10_000)
    spend(ledger, "daily", "a", 100, 90)
    spend(ledger, "forever", "b", 100, 90)
    clock.advance(days=30)  # February
    spend(ledger, "daily", "c", 100, 90)
    with ledger.engine.connect() as conn:
        where = dict(
            conn.execute(
                text(
                    "SELECT j.tableoid::regclass::text, COUNT(*) FROM journal j "
                    "GROUP BY 1 ORDER BY 1"
                )
            ).all()
        )
    assert where == {"journal_none": 2, "journal_y2026m01": 2, "journal_y2026m02": 2}
    assert ledger.audit() == []


def test_a_month_is_archived_only_when_nothing_in_it_can_change(
    ledger: Ledger, clock: ManualClock, tmp_path: Path
) -> None:
    ledger.create_budget("daily", 10_000, period="day")
    ledger.create_budget("other", 10_000, period="day")
    for i in range(5):
        spend(ledger, "daily", f"jan-{i}", 100, 90 + i)
    # one attempt of January still holds money, and its operation is unfinished
    held = ledger.calls.admit(
        "held", fingerprint="f", owner="me", lease=timedelta(minutes=5), max_runs=3
    )
    ledger.calls.reserve("other", "held#1", 300, operation_id=held.operation_id)
    ledger.calls.mark_sending("held#1")
    assert ledger.audit() == []

    # inside the window: kept
    clock.advance(days=40)  # 19 February
    assert ledger.upkeep.retain(KEEP, archive_to=tmp_path).archived == ()
    states = {p.name: p.state for p in ledger.upkeep.retention(KEEP)}
    assert states["journal_y2026m01"] == "kept"
    assert states["journal_y2026m02"] == "current"

    # past the window, January's periods are still open until they are renewed
    clock.advance(days=60)  # 20 April: January ended more than 60 days ago
    [view] = [p for p in ledger.upkeep.retention(KEEP) if p.name == "journal_y2026m01"]
    assert view.state == "blocked"
    assert any("open period" in b for b in view.blockers)
    renew_periods(ledger)  # opens today's periods, closing January's
    [view] = [p for p in ledger.upkeep.retention(KEEP) if p.name == "journal_y2026m01"]
    assert view.state == "blocked"
    assert view.blockers == (
        "1 attempt(s) still holding money",
        "1 unfinished operation(s)",
    )
    ran = ledger.upkeep.retain(KEEP, archive_to=tmp_path)
    assert ran.archived == () and "journal_y2026m01" in ran.blocked
    assert "journal_y2026m01" in _partitions(ledger)
    assert not (tmp_path / "journal_y2026m01").exists()

    # the hold settles (late, into its closed period) and its operation finishes
    ledger.calls.settle("held#1", 250)
    ledger.calls.finish_operation(held.operation_id, result="late")
    journal_before = _count(ledger, "SELECT COUNT(*) FROM journal")
    january_rows = _count(ledger, "SELECT COUNT(*) FROM journal WHERE period_start < '2026-02-01'")
    spent = {b: ledger.balance(b) for b in ("daily", "other")}
    ran = ledger.upkeep.retain(KEEP, archive_to=tmp_path)
    assert ran.archived == ("journal_y2026m01",)
    assert ran.attempts == 6
    # the late one finished today: it stays until its own completion is past the window
    assert ran.operations == 5
    assert "journal_y2026m01" not in _partitions(ledger)
    assert _count(ledger, "SELECT COUNT(*) FROM journal") == journal_before - january_rows
    assert _count(ledger, "SELECT COUNT(*) FROM attempts") == 0
    for i in range(5):
        with pytest.raises(UnknownOperation):
            ledger.operation(f"jan-{i}")
    assert ledger.operation("held").status == "succeeded"
    # what a budget shows today does not change, and both audits prove every period
    assert {b: ledger.balance(b) for b in ("daily", "other")} == spent
    assert ledger.audit() == []
    assert ledger.audit(full=True) == []
    assert ledger.audit() == []

    # the archive: every row that left, as COPY wrote it, and a manifest that counts them
    month = tmp_path / "journal_y2026m01"
    manifest = json.loads((month / "MANIFEST.json").read_text())
    assert manifest["journal_rows"] == january_rows
    assert manifest["attempts_rows"] == 6
    with (month / "journal.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == january_rows
    charged = sum(int(r["spent_delta"]) for r in rows)
    assert charged == sum(90 + i for i in range(5)) + 250
    with (tmp_path / "operations.csv").open(newline="") as f:
        assert sorted(r["key"] for r in csv.DictReader(f)) == [f"jan-{i}" for i in range(5)]
    [archived] = [p for p in ledger.upkeep.retention(KEEP) if p.state == "archived"]
    assert (archived.name, archived.rows, archived.kept_as) == (
        "journal_y2026m01",
        january_rows,
        str(month),
    )


def test_a_period_that_never_closes_keeps_its_rows(
    ledger: Ledger, clock: ManualClock, tmp_path: Path
) -> None:
    ledger.create_budget("forever", 10_000)
    spend(ledger, "forever", "a", 100, 90)
    clock.advance(days=200)
    renew_periods(ledger)
    ran = ledger.upkeep.retain(KEEP, archive_to=tmp_path)
    assert ran.attempts == 0 and ran.operations == 0
    assert _count(ledger, "SELECT COUNT(*) FROM journal_none") == 2
    states = {p.name: p.state for p in ledger.upkeep.retention(KEEP)}
    assert states["journal_none"] == "none"
    assert ledger.audit(full=True) == []


def test_a_month_whose_journal_does_not_prove_it_is_not_archived(
    ledger: Ledger, clock: ManualClock, tmp_path: Path
) -> None:
    ledger.create_budget("daily", 10_000, period="day")
    spend(ledger, "daily", "a", 100, 90)
    clock.advance(days=100)
    renew_periods(ledger)
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE budget_periods SET spent = spent + 1 WHERE closed_at IS NOT NULL")
        )
    ran = ledger.upkeep.retain(KEEP, archive_to=tmp_path)
    assert ran.blocked["journal_y2026m01"] == (
        "1 period(s) whose journal does not prove them: audit",
    )
    assert "journal_y2026m01" in _partitions(ledger)


def test_archiving_a_month_the_audit_had_not_reached_keeps_the_audit_clean(
    ledger: Ledger, clock: ManualClock, tmp_path: Path
) -> None:
    ledger.create_budget("daily", 10_000, period="day")
    spend(ledger, "daily", "a", 100, 90)
    assert ledger.audit() == []  # the position is past these rows ...
    clock.advance(days=20)
    spend(ledger, "daily", "b", 100, 80)  # ... not these (still January)
    clock.advance(days=80)
    renew_periods(ledger)
    assert ledger.upkeep.retain(KEEP, archive_to=tmp_path).archived == ("journal_y2026m01",)
    # the audit's checkpoints hold the rows it had not reached, as they left
    mismatched = _count(
        ledger,
        "SELECT COUNT(*) FROM archived_periods a LEFT JOIN audit_checkpoints c "
        "USING (period_id) WHERE c.period_id IS NULL OR (c.held, c.spent, c.overrun, "
        "c.drawn, c.granted) <> (a.held, a.spent, a.overrun, a.drawn, a.granted)",
    )
    assert _count(ledger, "SELECT COUNT(*) FROM archived_periods") == 2  # 10 and 30 January
    assert mismatched == 0
    assert ledger.upkeep.audit_size() <= 2  # only April's period openings, if any
    assert ledger.audit() == []
    assert ledger.audit(full=True) == []


def test_every_partition_refuses_truncate_and_an_archived_month_still_leaves(
    ledger: Ledger, clock: ManualClock, tmp_path: Path
) -> None:
    """Each partition has its own TRUNCATE guard (PostgreSQL does not clone the
    journal's): journal_none and journal_default made with the journal, the months the
    beat's partition code made. Retention's DETACH and DROP of an archived month are not
    refused, and the audit, which had proved that month's rows, expects them gone."""
    ledger.create_budget("daily", 10_000, period="day")
    ledger.create_budget("forever", 10_000)
    spend(ledger, "daily", "a", 100, 90)
    spend(ledger, "forever", "b", 100, 90)
    names = sorted(_partitions(ledger))
    assert {"journal_none", "journal_default", "journal_y2026m01", "journal_y2026m07"} <= set(names)
    for name in ["journal", *names]:
        refused = pytest.raises(Exception, match=r"append-only \(TRUNCATE refused\)")
        with refused, ledger.engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {name}"))
    assert _count(ledger, "SELECT COUNT(*) FROM journal") == 4
    assert ledger.audit() == []
    assert _count(ledger, "SELECT COUNT(*) FROM audit_partitions") == 2  # none, January
    clock.advance(days=100)
    renew_periods(ledger)
    assert ledger.upkeep.retain(KEEP, archive_to=tmp_path).archived == ("journal_y2026m01",)
    assert "journal_y2026m01" not in _partitions(ledger)
    assert ledger.audit() == []
    assert ledger.audit(full=True) == []
    assert ledger.audit() == []


def test_bad_retention_input_is_refused_and_changes_nothing(
    ledger: Ledger, tmp_path: Path, sqlite_ledger: Ledger
) -> None:
    tmp_path = tmp_path / "archive"
    tmp_path.mkdir()
    with pytest.raises(RetentionRefused, match="under 1 day"):
        ledger.upkeep.retain(timedelta(hours=23), archive_to=tmp_path)
    with pytest.raises(RetentionRefused, match="does not exist"):
        ledger.upkeep.retain(KEEP, archive_to=tmp_path / "missing")
    with pytest.raises(TypeError):
        ledger.upkeep.retain(60, archive_to=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(RetentionRefused, match="PostgreSQL"):
        sqlite_ledger.upkeep.retain(KEEP, archive_to=tmp_path)
    assert sqlite_ledger.upkeep.make_partitions() == []
    assert list(tmp_path.iterdir()) == []


def _make_partitions(url: str, at: datetime) -> list[str]:
    ledger = Ledger(url, clock=ManualClock(at))
    try:
        return ledger.upkeep.make_partitions(ahead=12)
    finally:
        ledger.dispose()


def test_two_beats_that_race_make_each_month_once(ledger: Ledger, pg_url: str) -> None:
    at = datetime(2031, 3, 5, tzinfo=UTC)
    made = race(_make_partitions, [(pg_url, at), (pg_url, at)])
    first, second = made
    assert sorted(first + second) == sorted({*first, *second})  # no month made twice
    assert len(first + second) == 13  # March 2031 and the 12 months after it
    assert {f"journal_y2031m{m:02d}" for m in range(3, 13)} <= _partitions(ledger)


def test_a_month_with_rows_in_the_default_partition_stays_there(
    pg_ledger: Ledger, clock: ManualClock
) -> None:
    clock.advance(datetime(2033, 5, 2, tzinfo=UTC) - clock())  # May 2033 has no partition
    pg_ledger.create_budget("daily", 10_000, period="day")
    spend(pg_ledger, "daily", "a", 100, 90)
    assert _count(pg_ledger, "SELECT COUNT(*) FROM journal_default") == 2
    made = pg_ledger.upkeep.make_partitions(ahead=1)
    assert made == ["journal_y2033m06"]  # May's rows keep it in the default partition
    spend(pg_ledger, "daily", "b", 100, 90)
    assert _count(pg_ledger, "SELECT COUNT(*) FROM journal_default") == 4
    assert pg_ledger.audit() == []


def _settle_while(url: str, at: datetime, budget: str, count: int) -> tuple[int, float, float]:
    ledger = Ledger(url, clock=ManualClock(at))
    try:
        began = time.time()
        for i in range(count):
            key = f"{budget}-{i}"
            ledger.calls.reserve(budget, key, 100)
            ledger.calls.mark_sending(key)
            ledger.calls.settle(key, 90)
        return count, began, time.time()
    finally:
        ledger.dispose()


def _retain_at(url: str, at: datetime, archive: str) -> tuple[tuple[str, ...], float, float]:
    ledger = Ledger(url, clock=ManualClock(at))
    try:
        time.sleep(0.2)  # the writers are under way
        began = time.time()
        archived = ledger.upkeep.retain(KEEP, archive_to=archive).archived
        return archived, began, time.time()
    finally:
        ledger.dispose()


def test_a_month_leaves_while_other_processes_settle_in_the_current_one(
    ledger: Ledger, clock: ManualClock, pg_url: str, tmp_path: Path
) -> None:
    ledger.create_budget("daily", 10_000_000, period="day")
    for i in range(3):
        spend(ledger, "daily", f"jan-{i}", 100, 90)
    april = JAN + timedelta(days=100)
    clock.advance(april - clock())
    renew_periods(ledger)
    for n in range(4):
        ledger.create_budget(f"live{n}", 10_000_000, period="day")
    calls = [(_settle_while, (pg_url, april, f"live{n}", 150)) for n in range(4)]
    calls.append((_retain_at, (pg_url, april, str(tmp_path))))
    *writers, (archived, began, ended) = race(_call, calls)
    assert [count for count, _, _ in writers] == [150] * 4
    assert archived == ("journal_y2026m01",)
    # the month left while the writers were settling, not before or after them all
    assert any(start < began and ended < end for _, start, end in writers)
    assert _count(ledger, "SELECT COUNT(*) FROM attempts") == 600
    assert ledger.balance("live0").spent == 150 * 90
    assert ledger.audit() == []
    assert ledger.audit(full=True) == []


def _call(fn: object, args: tuple[object, ...]) -> object:
    assert callable(fn)
    return fn(*args)


def _finish_calls(url: str, prefix: str, count: int) -> tuple[int, float, float]:
    """``count`` operations, each a settled call and a stored result, in this process."""
    ledger = Ledger(url)
    try:
        began = time.time()
        for i in range(count):
            spend(ledger, "live", f"{prefix}-{i}", 100, 90)
        return count, began, time.time()
    finally:
        ledger.dispose()


def _purge_repeatedly(url: str, rounds: int) -> tuple[int, float, float]:
    ledger = Ledger(url)
    try:
        time.sleep(0.2)  # the writers are under way
        began, purged = time.time(), 0
        for _ in range(rounds):
            purged += ledger.upkeep.purge_operations(timedelta(0), batch=7).operations
        return purged, began, time.time()
    finally:
        ledger.dispose()


def test_the_purge_in_batches_under_concurrent_settlements(pg_url: str, pg_ledger: Ledger) -> None:
    pg_ledger.create_budget("live", 10**9)
    calls = [(_finish_calls, (pg_url, f"w{n}", 60)) for n in range(4)]
    calls.append((_purge_repeatedly, (pg_url, 20)))
    *writers, (purged, began, ended) = race(_call, calls)
    assert [count for count, _, _ in writers] == [60] * 4
    assert any(start < began and ended < end for _, start, end in writers)
    assert purged > 0  # it purged while they wrote
    # a last purge finds every result that was left, and the money is all there
    now = Ledger(pg_url)  # the writers' clock, not this module's January
    rest = now.upkeep.purge_operations(timedelta(0)).operations
    now.dispose()
    assert purged + rest == 240
    assert _count(pg_ledger, "SELECT COUNT(*) FROM operations WHERE result IS NOT NULL") == 0
    assert _count(pg_ledger, "SELECT COUNT(*) FROM attempts WHERE state = 'settled'") == 240
    assert pg_ledger.balance("live").spent == 240 * 90
    assert pg_ledger.audit() == []


def test_the_cli_shows_the_partitions_then_archives_what_is_due(
    pg_url: str, pg_ledger: Ledger, tmp_path: Path, sqlite_url: str
) -> None:
    may = ManualClock(datetime(2025, 5, 7, tzinfo=UTC))
    then = Ledger(pg_url, clock=may)
    then.upkeep.make_partitions(ahead=1)
    then.create_budget("daily", 10_000, period="day")
    spend(then, "daily", "may-1", 100, 90)
    may.advance(days=1)
    renew_periods(then)  # the 7th closes
    then.dispose()

    shown = cli(pg_url, "retention", "show", "--keep-days", "90", "--json")
    assert shown.returncode == 0, shown.stderr
    states = {p["name"]: p for p in json.loads(shown.stdout)["partitions"]}
    assert states["journal_y2025m05"]["state"] == "blocked"  # the 8th is still open
    assert states["journal_y2025m05"]["blockers"] == ["1 open period(s)"]
    table = cli(pg_url, "retention", "show", "--keep-days", "90").stdout
    assert "journal_y2025m05  2025-05  blocked" in table
    assert "1 open period(s)" in table

    refused = cli(pg_url, "retention", "run", "--keep-days", "90", "--archive-to", str(tmp_path))
    assert refused.returncode == 1
    assert "kept journal_y2025m05: 1 open period(s)" in refused.stdout
    assert not (tmp_path / "journal_y2025m05").exists()

    Ledger(pg_url).upkeep.open_period("daily")  # today's opens: May's 8th closes
    done = cli(pg_url, "retention", "run", "--keep-days", "90", "--archive-to", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"archived journal_y2025m05 to {tmp_path}" in done.stdout
    assert "removed 1 attempts and 1 operations" in done.stdout
    assert (tmp_path / "journal_y2025m05" / "MANIFEST.json").exists()
    after = json.loads(cli(pg_url, "retention", "show", "--json").stdout)["partitions"]
    [archived] = [p for p in after if p["name"] == "journal_y2025m05"]
    assert (archived["state"], archived["rows"]) == ("archived", 2)
    assert cli(pg_url, "audit", "--full").returncode == 0

    # SQLite: one clear line, exit 2, nothing written
    on_sqlite = cli(sqlite_url, "retention", "show")
    assert on_sqlite.returncode == 2
    assert "retention needs PostgreSQL" in on_sqlite.stderr
    missing = cli(pg_url, "retention", "run", "--keep-days", "90")
    assert missing.returncode == 2 and "--archive-to" in missing.stderr
