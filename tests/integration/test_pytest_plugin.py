"""The pytest plugin users get with the package, run as a user runs it: pytest in a new
process on the documented example (examples/test_summarize.py), in a directory of its
own, loaded through the package's entry point (no conftest, no -p)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from ..services import PG_ADMIN_URL, pg_conninfo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "test_summarize.py"


def run_example(tmp_path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    if not (tmp_path / EXAMPLE.name).exists():
        shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", EXAMPLE.name, *options],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_the_example_passes_on_sqlite_and_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The fixtures check something: the same test with the replay assertion inverted
    fails."""
    done = run_example(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    broken = (
        (tmp_path / EXAMPLE.name)
        .read_text()
        .replace("assert again == first", "assert again != first")
    )
    (tmp_path / EXAMPLE.name).write_text(broken)
    done = run_example(tmp_path)
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout


@pytest.mark.postgres
def test_the_example_passes_on_postgresql_and_drops_its_databases(
    tmp_path: Path, pg_url: str
) -> None:
    def throwaway() -> set[str]:
        with psycopg.connect(pg_conninfo(PG_ADMIN_URL), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE 'budget_tasks_test_%%'"
            ).fetchall()
        return {name for (name,) in rows}

    before = throwaway()
    # the option is what the fixtures use: a server that is not there fails every test
    nowhere = run_example(tmp_path, "--budget-ledger-url", "postgresql://postgres@127.0.0.1:1/x")
    assert nowhere.returncode == 1 and "2 errors" in nowhere.stdout, nowhere.stdout
    done = run_example(tmp_path, "--budget-ledger-url", PG_ADMIN_URL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert throwaway() == before
