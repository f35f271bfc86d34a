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
from budget_tasks.testing import ManualClock
from budget_tasks.testing.harness import race

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
