"""pytest fixtures for testing your own BudgetTasks (loaded automatically: the package
registers this module as a pytest plugin).

- ``budget_ledger``: a throwaway ledger with its schema: SQLite in the test's
  temporary directory, or a new PostgreSQL database (dropped after the test) on the
  server of ``--budget-ledger-url`` / env ``BUDGET_TASKS_TEST_LEDGER_URL``. Budgets
  come from the ``budgets`` marker: ``@pytest.mark.budgets(acme=5_000_000)``.
- ``fake_llm``: the fake OpenAI/Anthropic provider on a loopback port, with
  ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL`` and test API keys set, so the official
  SDKs (and the guarded clients built without a base URL) talk to it.
- ``budget_eager``: wires a Celery app for a test in eager mode against
  ``budget_ledger``: ``budget_eager(app)`` (no broker, no worker).
- ``budget_celery_config``: for Celery's own fixtures (``celery_app``,
  ``celery_worker``, from pytest-celery or ``celery.contrib.pytest``): an in-memory
  broker and results and this test's ledger; return it from ``celery_config``, and a
  real worker thread runs the tasks.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..config import LEDGER_URL_SETTING, close_ledgers
from ..ledger import Ledger
from ..ledger.engine import normalise_url
from .fake_provider import FakeProvider

TEST_LEDGER_ENV = "BUDGET_TASKS_TEST_LEDGER_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--budget-ledger-url",
        default=None,
        help="a PostgreSQL server URL for budget_ledger: each test gets a new database "
        f"there (default: env {TEST_LEDGER_ENV}, else SQLite in tmp_path)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "budgets(**caps): budgets (name=cap in minor units) in budget_ledger"
    )


def _postgres_database(server_url: str) -> Iterator[str]:
    """A new database on the server of ``server_url``; its URL, dropped after."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(normalise_url(server_url))
    name = f"budget_tasks_test_{uuid.uuid4().hex[:12]}"
    admin = url.set(drivername="postgresql", database=url.database or "postgres")
    conninfo = admin.render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')  # a generated name, not input
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        close_ledgers()
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def budget_ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a new, empty ledger database with the schema, for one test."""
    server = request.config.getoption("--budget-ledger-url") or os.environ.get(TEST_LEDGER_ENV)
    if server:
        yield from _postgres_database(server)
    else:
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        close_ledgers()


@pytest.fixture
def budget_ledger(request: pytest.FixtureRequest, budget_ledger_url: str) -> Iterator[Ledger]:
    """A throwaway :class:`Ledger`, with the budgets of the ``budgets`` marker."""
    ledger = Ledger(budget_ledger_url)
    ledger.create_schema()
    for marker in request.node.iter_markers("budgets"):
        for name, cap in marker.kwargs.items():
            ledger.create_budget(name, cap)
    try:
        yield ledger
    finally:
        ledger.dispose()


@pytest.fixture
def fake_llm(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeProvider]:
    """The fake provider, and the environment the official SDKs read pointed at it;
    guarded clients a task module built at import (before this fixture) are pointed at
    it too, where they were not given a base URL or a key of their own."""
    from ..transport.clients import repoint

    with FakeProvider() as fake:
        keys = {"openai": "sk-fake", "anthropic": "sk-ant-fake"}
        monkeypatch.setenv("OPENAI_BASE_URL", fake.openai_base_url)
        monkeypatch.setenv("OPENAI_API_KEY", keys["openai"])
        monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", keys["anthropic"])
        restore = repoint({"openai": fake.openai_base_url, "anthropic": fake.url}, keys)
        try:
            yield fake
        finally:
            restore()


@pytest.fixture
def budget_eager(budget_ledger: Ledger, budget_ledger_url: str) -> Iterator[Callable[[Any], Any]]:
    """``budget_eager(app)``: the app runs tasks eagerly (errors propagate) against
    ``budget_ledger``; its settings are put back after the test."""
    changed: list[tuple[Any, dict[str, Any]]] = []

    def wire(app: Any) -> Any:
        keys = ("task_always_eager", "task_eager_propagates", LEDGER_URL_SETTING)
        changed.append((app, {k: app.conf.get(k) for k in keys}))
        app.conf.update(
            task_always_eager=True,
            task_eager_propagates=True,
            **{LEDGER_URL_SETTING: budget_ledger_url},
        )
        return app

    try:
        yield wire
    finally:
        close_ledgers()
        for app, before in reversed(changed):
            app.conf.update(before)
            _forget_connections(app)


def _forget_connections(app: Any) -> None:
    """Drop what Celery keeps, made from the app's settings, once used: an eager
    ``delay()`` still takes a producer from a pool for the app's broker, and a run makes
    the thread's result backend. A later test of the same app with other settings
    (Celery's worker fixture, in memory) would publish to that broker and wait on that
    backend."""
    app.close()  # the broker connection pool
    with contextlib.suppress(AttributeError):
        del app.amqp  # and its producer pool, made anew from the settings when next used
    vars(app._local).pop("backend", None)  # this thread's result backend


@pytest.fixture
def budget_celery_config(
    budget_ledger: Ledger, budget_ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    """Settings for Celery's own test fixtures (``celery_app``, ``celery_worker``: a real
    worker in a thread): an in-memory broker and result store, and this test's ledger.
    Return it from your ``celery_config`` fixture."""
    # Celery reads these variables over any app setting: a shell (or a compose file)
    # that exports them would send the test's messages to that broker, production's
    # included. Gone for this test only.
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield {
            "broker_url": "memory://",
            "result_backend": "cache+memory://",
            LEDGER_URL_SETTING: budget_ledger_url,
        }
    finally:
        close_ledgers()
