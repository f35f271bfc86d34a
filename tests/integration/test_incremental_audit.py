"""The incremental audit: it reads only the journal rows after the position the last
audit reached, proves the open periods and the periods those rows touch, and never
skips a row that committed late with a lower id (both backends; the late commit and
audits at once on PostgreSQL, with separate connections and processes)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.ledger import statements as sql
from budget_tasks.testing import ManualClock
from tests.support import race

from ..services import pg_conninfo


def settle(ledger: Ledger, key: str, amount: int, actual: int, budget: str = "acme") -> None:
    ledger.calls.reserve(budget, key, amount)
    ledger.calls.mark_sending(key)
    ledger.calls.settle(key, actual)


def test_an_audit_reads_only_what_came_after_the_last_one(ledger: Ledger) -> None:
    ledger.create_budget("acme", 10_000)
    for i in range(20):
        settle(ledger, f"k{i}", 100, 90)
    assert ledger.upkeep.audit_size() == 40  # every row: no audit yet
    assert ledger.audit() == []
    assert ledger.upkeep.audit_size() == 0
    settle(ledger, "late", 100, 120)
    assert ledger.upkeep.audit_size() == 2  # its hold and its charge
    assert ledger.audit() == []
    full = ledger.upkeep.audit_size(full=True)
    # SQLite counts; PostgreSQL says its planner's estimate (exact only once analysed)
    assert full == 42 if ledger.engine.dialect.name == "sqlite" else full >= 0
    assert ledger.audit(full=True) == []


def test_a_counter_changed_behind_the_journal_is_found_in_an_open_period(ledger: Ledger) -> None:
    ledger.create_budget("acme", 1_000)
    settle(ledger, "k1", 100, 90)
    assert ledger.audit() == []
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE budget_periods SET spent = spent + 7"))
    [finding] = ledger.audit()  # no journal row since: the open period is proved anyway
    assert (finding.counter, finding.recorded, finding.journal) == ("spent", 97, 90)
    # the checkpoint keeps what the journal proves, not the counter: found again
    assert [f.counter for f in ledger.audit()] == ["spent"]


def test_a_closed_period_changed_behind_the_journal_needs_a_full_audit(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("daily", 1_000, period="day")
    settle(ledger, "k1", 100, 90, budget="daily")
    clock.advance(days=1)
    settle(ledger, "k2", 100, 80, budget="daily")  # yesterday is closed now
    assert ledger.audit() == []
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE budget_periods SET spent = spent + 1 WHERE closed_at IS NOT NULL")
        )
    assert ledger.audit() == []  # nothing touched it since, and it is closed
    [finding] = ledger.audit(full=True)
    assert (finding.counter, finding.recorded, finding.journal) == ("spent", 91, 90)
    # a late charge on the closed period brings it back into the incremental audit
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE budget_periods SET spent = spent - 1 WHERE closed_at IS NOT NULL")
        )
    ledger.adjust("k1", 5, "invoice line")
    assert ledger.audit() == []


def test_a_journal_row_that_commits_late_with_a_lower_id_is_never_skipped(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("acme", 1_000)
    pg_ledger.create_budget("other", 1_000)
    settle(pg_ledger, "k1", 100, 90)
    settle(pg_ledger, "o1", 100, 90, budget="other")
    assert pg_ledger.audit() == []
    with pg_ledger.engine.connect() as conn:
        period_id = conn.execute(
            text(
                "SELECT p.id FROM budget_periods p JOIN budgets b ON b.id = p.budget_id "
                "WHERE b.name = 'other'"
            )
        ).scalar_one()
    # A writer takes its journal id and has not committed yet ...
    late = psycopg.connect(pg_conninfo(pg_url))
    late.execute(
        "INSERT INTO journal (attempt_id, period_id, kind, held_delta, spent_delta, "
        "note, created_at, period_start) VALUES (NULL, %s, 'adjustment', 0, 5, 'late', now(), "
        "(SELECT period_start FROM budget_periods WHERE id = %s))",
        (period_id, period_id),
    )
    late.execute("UPDATE budget_periods SET spent = spent + 5 WHERE id = %s", (period_id,))
    # ... while another writer commits a row with a higher id
    settle(pg_ledger, "k2", 100, 50)
    found: list[object] = []
    auditor = threading.Thread(target=lambda: found.append(pg_ledger.audit()))
    auditor.start()
    time.sleep(1.0)
    assert auditor.is_alive(), "the audit must wait for the writer in flight"
    late.commit()
    late.close()
    auditor.join(timeout=30)
    assert found == [[]]
    # the late row is inside what the audit proved: the next ones agree
    assert pg_ledger.audit() == []
    assert pg_ledger.audit(full=True) == []


def audit_while_writing(url: str, seed: int) -> int:
    ledger = Ledger(url)
    bad = 0
    try:
        for i in range(15):
            settle(ledger, f"w{seed}-{i}", 10, 9 + i % 3)
            if i % 5 == seed % 5:
                bad += len(ledger.audit())
    finally:
        ledger.dispose()
    return bad


def test_audits_at_once_with_writers_agree_with_a_full_audit(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("acme", 10**9)
    findings = race(audit_while_writing, [(pg_url, seed) for seed in range(12)])
    assert findings == [0] * 12
    assert pg_ledger.audit() == []
    assert pg_ledger.audit(full=True) == []


@pytest.mark.parametrize("full", [False, True])
def test_the_cli_says_how_much_it_reads(ledger: Ledger, backend_url: str, full: bool) -> None:
    import subprocess
    import sys

    ledger.create_budget("acme", 1_000)
    settle(ledger, "k1", 100, 90)
    args = [sys.executable, "-m", "budget_tasks.cli", "audit", *(["--full"] if full else [])]
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "BUDGET_TASKS_LEDGER_URL": backend_url},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "every counter equals its journal" in done.stdout
    assert "journal rows" in done.stderr
    if not full:
        assert "reading 2 journal rows" in done.stderr


def _lose(ledger: Ledger, partition: str, how: str) -> None:
    """Take the rows of ``partition`` behind the journal, as a superuser could: its
    TRUNCATE guard off for one TRUNCATE, or the partition detached."""
    with ledger.engine.begin() as conn:
        if how == "truncate":
            conn.execute(text(f"ALTER TABLE {partition} DISABLE TRIGGER journal_no_truncate"))
            conn.execute(text(f"TRUNCATE {partition}"))
            conn.execute(text(f"ALTER TABLE {partition} ENABLE TRIGGER journal_no_truncate"))
        else:
            conn.execute(text(f"ALTER TABLE journal DETACH PARTITION {partition}"))


@pytest.mark.parametrize(
    ("budget", "how"),
    [("monthly", "truncate"), ("monthly", "detach"), ("forever", "truncate")],
)
def test_a_partition_that_lost_its_rows_is_found_by_the_incremental_audit(
    pg_ledger: Ledger, pg_url: str, clock: ManualClock, budget: str, how: str
) -> None:
    """The incremental audit reads only the rows after its position, so the sums it
    proved stand after a partition lost its rows: what it proved of each partition (its
    lowest and highest row, by key) finds it, in every audit after, and the CLI exits 1."""
    from datetime import UTC, datetime

    from budget_tasks.ledger.partitions import month_start, name_of

    from .test_cli import cli

    pg_ledger.upkeep.make_partitions(ahead=0)
    pg_ledger.create_budget("monthly", 10_000, period="month")
    pg_ledger.create_budget("forever", 10_000)
    for i in range(3):
        settle(pg_ledger, f"m{i}", 100, 90, budget="monthly")
    settle(pg_ledger, "f0", 100, 90, budget="forever")
    assert pg_ledger.audit() == []
    settle(pg_ledger, "m3", 100, 90, budget="monthly")  # proved by the next audit
    assert pg_ledger.audit() == []
    month = name_of(month_start(clock()))
    partition, start, rows = (
        (month, month_start(clock()), 8)
        if budget == "monthly"
        else ("journal_none", datetime(1970, 1, 1, tzinfo=UTC), 2)
    )
    _lose(pg_ledger, partition, how)
    try:
        lost = (partition, start, "rows", rows, 0)
        findings = pg_ledger.audit()
        assert [(f.budget, f.period_start, f.counter, f.recorded, f.journal) for f in findings] == [
            lost
        ]
        assert pg_ledger.audit() == findings  # still found: nothing was taken back
        # a full audit finds it too, and the counter its rows proved (what they held
        # nets to 0: a hold and its charge)
        full = pg_ledger.audit(full=True)
        assert findings[0] in full and {f.counter for f in full} == {"rows", "spent"}
        done = cli(pg_url, "audit")
        assert done.returncode == 1 and partition in done.stdout, done.stdout + done.stderr
    finally:
        if how == "detach":  # the session's database makes it again when it needs it
            with pg_ledger.engine.begin() as conn:
                conn.execute(text(f"DROP TABLE {partition}"))


def test_the_audit_reads_each_partition_it_proved_by_key(pg_ledger: Ledger) -> None:
    """What the audit keeps of each partition: its lowest and highest row and how many,
    added to by each audit; the check of them is a lookup by key, not a scan."""
    pg_ledger.upkeep.make_partitions(ahead=0)
    pg_ledger.create_budget("monthly", 10_000, period="month")
    settle(pg_ledger, "a", 100, 90, budget="monthly")
    assert pg_ledger.audit() == []
    settle(pg_ledger, "b", 100, 90, budget="monthly")
    assert pg_ledger.audit() == []
    with pg_ledger.engine.connect() as conn:
        kept = conn.execute(
            text("SELECT partition, low_id, high_id, journal_rows FROM audit_partitions")
        ).all()
        ids = conn.execute(text("SELECT MIN(id), MAX(id) FROM journal")).one()
        plan = "\n".join(
            conn.execute(
                text(
                    "EXPLAIN (COSTS OFF) "
                    + sql.LOST_PARTITIONS.replace(
                        "IN (SELECT r.partition FROM archives r)", "IN ('')"
                    )
                )
            ).scalars()
        )
    assert [tuple(k) for k in kept] == [("journal_y2026m01", ids[0], ids[1], 4)]
    # a lookup per recorded partition, by its key: never a join or a hash of the journal
    assert "Join" not in plan and "Hash" not in plan, plan
    assert "(id = a.low_id) AND (period_start = a.low_start)" in plan, plan
    assert pg_ledger.audit(full=True) == []
