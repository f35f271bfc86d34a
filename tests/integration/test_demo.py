"""The README's first command: the walk-through on embedded defaults, as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_on_embedded_defaults_and_every_check_holds(tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGET_TASKS_")}
    done = subprocess.run(
        [sys.executable, "-m", "budget_tasks.cli", "demo", "--workers", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "ledger: sqlite:///" in out
    assert "admitted 3, denied 3" in out
    assert "[FAILED]" not in out
    assert out.count("[ok]") == 9
    assert "all invariants held" in out


def test_demo_against_postgres(pg_url: str) -> None:
    from budget_tasks import Ledger

    from ..conftest import empty_ledger_tables

    empty_ledger_tables(pg_url)
    done = subprocess.run(
        [sys.executable, "-m", "budget_tasks.cli", "demo", "--ledger-url", pg_url],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ledger: {pg_url}" in done.stdout
    ledger = Ledger(pg_url)
    assert ledger.balance("support-bot").held == 30_000
    assert ledger.audit() == []
    ledger.dispose()
