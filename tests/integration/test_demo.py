"""`budget-tasks demo` as a user runs it (a subprocess with a real `celery worker`)
against PostgreSQL and Redis, and the ledger walk-through, `budget-tasks walkthrough`.
On its embedded defaults the demo runs from an installed wheel: tests/acceptance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

from budget_tasks import Ledger

from ..conftest import empty_ledger_tables
from ..demo_output import DEMO_CLAIMS
from ..services import REDIS_HOST, REDIS_PORT, check_redis, redis_db

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("BUDGET_TASKS_", "CELERY_"))}
    return subprocess.run(
        [sys.executable, "-m", "budget_tasks.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, **(env or {})},
        cwd=ROOT,
        check=False,
    )


def test_demo_against_postgres_and_redis_leaves_a_ledger_that_audits_clean(pg_url: str) -> None:
    check_redis()
    redis.Redis(REDIS_HOST, REDIS_PORT, db=redis_db("demo")).flushdb()
    empty_ledger_tables(pg_url)
    ledger = Ledger(pg_url)
    ledger.create_budget("acme", 1_000)  # taken: the demo makes its own budgets beside it
    broker = f"redis://{REDIS_HOST}:{REDIS_PORT}/{redis_db('demo')}"
    done = cli("demo", "--ledger-url", pg_url, "--broker-url", broker)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"ledger    {pg_url}" in out and f"broker    {broker}" in out
    assert out.count("[ok]") == DEMO_CLAIMS and "[FAILED]" not in out
    names = {b.name for b in ledger.budgets()}
    [acme] = [n for n in names if n.startswith("acme-")]
    assert "globex" in names and ledger.balance("acme").spent == 0
    for name in (acme, "globex"):
        balance = ledger.balance(name)
        assert balance.held == 0 and 0 < balance.spent <= balance.cap
        attempts = ledger.attempts(budget=name)
        # every call that went out settled at its bill; what was released is a job's
        # main hold of 0 (the reference task's calls reserve for themselves) whose call
        # was denied, or a killed run's
        calls = [a for a in attempts if ":openai.chat:" in a.key]
        assert calls and {a.state for a in calls} == {"settled"}
        rest = [a for a in attempts if a not in calls]
        assert {a.state for a in rest} <= {"settled", "released"}
        assert all(a.amount == 0 and "#" in a.key for a in rest)
    assert ledger.audit() == []
    ledger.dispose()


def test_walkthrough_runs_on_embedded_defaults_and_every_check_holds() -> None:
    done = cli("walkthrough", "--workers", "6")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "ledger: sqlite:///" in out
    assert "admitted 3, denied 3" in out
    assert "[FAILED]" not in out
    assert out.count("[ok]") == 9
    assert "all invariants held" in out


def test_walkthrough_against_postgres(pg_url: str) -> None:
    empty_ledger_tables(pg_url)
    done = cli("walkthrough", "--ledger-url", pg_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ledger: {pg_url}" in done.stdout
    ledger = Ledger(pg_url)
    assert ledger.balance("support-bot").held == 30_000
    assert ledger.audit() == []
    ledger.dispose()
