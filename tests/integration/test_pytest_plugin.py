"""The pytest plugin users get with the package, run as a user runs it: pytest in a new
process on the documented example (examples/test_summarize.py), in a directory of its
own, loaded through the package's entry point (no conftest, no -p)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
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


def users_directory(
    tmp_path: Path, files: dict[str, str], **extra: str
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """A user's directory with ``files``, and a runner of ``python ARGS`` in it with no
    provider or budget-tasks variable in its environment (but ``extra``)."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENAI_", "ANTHROPIC_", "BUDGET_TASKS_", "CELERY_"))
    }
    env["PYTHONPATH"] = str(tmp_path)
    env.update(extra)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )

    return run


JOBS = """
from celery import Celery

from budget_tasks import BudgetTask
from budget_tasks.transport import guarded_openai_client

app = Celery("jobs")
client = guarded_openai_client(timeout=30.0)  # built at import, as a module does


@app.task(
    base=BudgetTask,
    bind=True,
    budget="acme",
    idempotency_key=lambda topic: f"ask:{topic}",
    estimate_cost=lambda topic: 0,
)
def ask(self, topic):
    answer = client.chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=16,
        messages=[{"role": "user", "content": topic}],
    )
    return answer.choices[0].message.content
"""

TEST_JOBS = """
import pytest

from jobs import app, ask


@pytest.mark.budgets(acme=1_000_000)
def test_ask_reaches_the_fake(budget_ledger, fake_llm, budget_eager):
    budget_eager(app)
    assert ask.delay("tides").get() == ask.delay("tides").get()
    assert len([s for s in fake_llm.served() if s.method == "POST"]) == 1
    assert budget_ledger.balance("acme").spent == fake_llm.state()["billed_total"] > 0


@pytest.mark.budgets(acme=1_000_000)
def test_without_the_fake_nothing_is_sent(budget_ledger, budget_eager):
    from budget_tasks import MissingApiKey

    budget_eager(app)
    with pytest.raises(MissingApiKey, match="OPENAI_API_KEY"):
        ask.delay("moon").get()
    assert budget_ledger.holds() == []
"""


def test_a_module_that_builds_its_client_at_import_needs_no_key_and_meets_fake_llm(
    tmp_path: Path,
) -> None:
    """A task module builds its guarded client at import, with no provider key and no
    base URL in the environment: it imports (so the CLI and a test suite need no
    secrets), fake_llm points that client at the fake, and without the fake a call is
    refused before anything is reserved or sent."""
    run = users_directory(tmp_path, {"jobs.py": JOBS, "test_jobs.py": TEST_JOBS})
    done = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "test_jobs.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    url = f"sqlite:///{tmp_path}/ledger.db"
    assert run("-m", "budget_tasks.cli", "db", "upgrade", "--ledger-url", url).returncode == 0
    status = run("-m", "budget_tasks.cli", "-A", "jobs", "status", "--ledger-url", url)
    assert status.returncode == 0, status.stderr


TEST_JOBS_IN_A_WORKER = """
import pytest

import jobs

# Celery's classic fixtures (pytest-celery 1.x's own celery_worker needs Docker)
pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture
def celery_config(budget_celery_config):
    return budget_celery_config


@pytest.fixture
def celery_worker_parameters():
    return {"perform_ping_check": False}  # the app has no celery.ping task


@pytest.fixture
def celery_app(celery_config):
    jobs.app.conf.update(celery_config)
    return jobs.app


@pytest.mark.budgets(acme=1_000_000)
def test_ask_eagerly_first(budget_ledger, fake_llm, budget_eager):
    budget_eager(jobs.app)  # Celery keeps a producer for the app's broker from this run
    assert jobs.ask.delay("waves").get()


@pytest.mark.budgets(acme=1_000_000)
def test_ask_through_a_real_worker(budget_ledger, fake_llm, celery_app, celery_worker):
    import threading

    first = jobs.ask.delay("tides").get(timeout=30)
    assert jobs.ask.delay("tides").get(timeout=30) == first
    assert len([s for s in fake_llm.served() if s.method == "POST"]) == 1
    assert budget_ledger.balance("acme").spent == fake_llm.state()["billed_total"] > 0
    assert budget_ledger.operation("ask:tides").deliveries == 2
    assert threading.active_count() > 1  # the worker is a thread of its own
"""


def test_a_budget_task_tested_through_celerys_own_worker_fixture(tmp_path: Path) -> None:
    """The fixtures Celery users already have (celery_app, celery_config, and
    celery_worker: a real worker in a thread, from pytest-celery's classic plugin) with
    the plugin's ledger and fake: the task is consumed from a broker by a worker, not
    run eagerly, and replays on its second delivery. The shell exports a broker (as a
    deployment's does) where nothing listens, and an eager test of the same app runs
    first: the worker test's messages still stay in memory."""
    run = users_directory(
        tmp_path,
        {"jobs.py": JOBS, "test_jobs.py": TEST_JOBS_IN_A_WORKER},
        CELERY_BROKER_URL="redis://127.0.0.1:9/0",
        CELERY_RESULT_BACKEND="redis://127.0.0.1:9/1",
    )
    done = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "test_jobs.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
