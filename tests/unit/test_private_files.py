"""The embedded SQLite files hold prompts, answers and spend: only their owner reads them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from budget_tasks import Ledger

ROOT = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_sqlite_ledger_and_its_folder_are_readable_by_their_owner_only(
    tmp_path: Path,
) -> None:
    old = os.umask(0o022)  # the common default, which leaves files world-readable
    try:
        path = tmp_path / "made" / "ledger.db"
        ledger = Ledger(f"sqlite:///{path}")
        ledger.create_schema()
        ledger.create_budget("team", 100)
        ledger.dispose()
    finally:
        os.umask(old)
    assert mode(path.parent) == 0o700
    assert mode(path) == 0o600
    assert Ledger(f"sqlite:///{path}").budget("team").cap == 100  # a working database


def test_an_existing_ledger_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    path.touch(mode=0o640)
    path.chmod(0o640)
    ledger = Ledger(f"sqlite:///{path}")
    ledger.create_schema()
    ledger.dispose()
    assert mode(path) == 0o640


def test_the_reference_apps_home_is_made_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "BUDGET_TASKS_"))}
    env["BUDGET_TASKS_HOME"] = str(home)
    subprocess.run(
        [sys.executable, "-c", "import workers.app"], cwd=ROOT, env=env, check=True, timeout=60
    )
    assert mode(home) == 0o700
