from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider, ManualClock

from .services import check_postgres, scratch_database

LEDGER_TABLES = (
    "archived_periods, archives, audit_position, audit_checkpoints, audit_partitions, journal, "
    "operation_events, side_effects, attempts, operations, budget_periods, budgets, "
    "rate_takes, rate_windows, rate_shares"
)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database for this test session, with the ledger schema."""
    check_postgres()
    with scratch_database() as url:
        Ledger(url).create_schema()
        yield url


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def empty_ledger_tables(url: str) -> None:
    from budget_tasks.config import close_ledgers

    close_ledgers()  # their caches hold ids of rows about to go
    ledger = Ledger(url)
    with ledger.engine.begin() as conn:
        # The journal refuses TRUNCATE; the tests' own reset runs with triggers off.
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        conn.execute(text(f"TRUNCATE {LEDGER_TABLES} RESTART IDENTITY CASCADE"))
    ledger.dispose()


@pytest.fixture
def pg_ledger(pg_url: str, clock: ManualClock) -> Iterator[Ledger]:
    empty_ledger_tables(pg_url)
    ledger = Ledger(pg_url, clock=clock)
    yield ledger
    ledger.dispose()


@pytest.fixture
def sqlite_url(tmp_path: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path}/ledger.db"
    Ledger(url).create_schema()
    return url


@pytest.fixture
def sqlite_ledger(sqlite_url: str, clock: ManualClock) -> Iterator[Ledger]:
    ledger = Ledger(sqlite_url, clock=clock)
    yield ledger
    ledger.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def backend_url(request: pytest.FixtureRequest) -> str:
    """The URL of a fresh ledger on each backend."""
    if request.param == "postgres":
        url: str = request.getfixturevalue("pg_url")
        empty_ledger_tables(url)
        return url
    return str(request.getfixturevalue("sqlite_url"))


@pytest.fixture
def ledger(backend_url: str, clock: ManualClock) -> Iterator[Ledger]:
    """A ledger on each backend (PostgreSQL and SQLite), with a manual clock."""
    ledger = Ledger(backend_url, clock=clock)
    yield ledger
    ledger.dispose()


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeProvider]:
    """The fake LLM provider, in a thread of the test process, for the whole session."""
    with FakeProvider() as server:
        yield server


@pytest.fixture
def fake(fake_server: FakeProvider) -> FakeProvider:
    """The fake provider with nothing served, billed or planned yet."""
    fake_server.reset()
    return fake_server
