"""The ledger's typed errors for a bad URL and for a database without the ledger schema."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from budget_tasks import (
    BudgetTasksError,
    Ledger,
    LedgerConfigError,
    LedgerUnavailable,
    SchemaMissing,
)
from budget_tasks.ledger.driver import Driver

from ..services import check_postgres, scratch_database

EXPECTED = "expected postgresql://USER@HOST:5432/DBNAME or sqlite:///PATH/ledger.db"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("notaurl", f"invalid ledger URL: it does not parse; {EXPECTED}"),
        ("", f"invalid ledger URL: it is empty; {EXPECTED}"),
        ("postgresql://u:secret@h:notaport/db", "invalid ledger URL: its port is not a number"),
        (
            "mysql://h/db",
            "invalid ledger URL: the ledger runs on PostgreSQL or SQLite, not 'mysql'",
        ),
        (
            "postgresql+nosuchdriver://h/db",
            "invalid ledger URL: no driver for 'postgresql+nosuchdriver' is installed: "
            "Can't load plugin: sqlalchemy.dialects:postgresql.nosuchdriver",
        ),
    ],
    ids=["notaurl", "empty", "port", "backend", "driver"],
)
def test_a_bad_ledger_url_raises_ledger_config_error(url: str, message: str) -> None:
    with pytest.raises(LedgerConfigError) as caught:
        Ledger(url)
    assert str(caught.value) == message  # and never the URL itself: it may hold a password
    assert isinstance(caught.value, ValueError)  # what callers caught before it had a type


@pytest.mark.parametrize(
    "error",
    [LedgerConfigError("it is empty"), SchemaMissing('relation "budgets" does not exist')],
    ids=lambda e: type(e).__name__,
)
def test_the_new_errors_pickle_with_their_facts(error: BudgetTasksError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.facts) == (type(error), str(error), error.facts)


@pytest.fixture(params=["sqlite", "postgres"])
def schemaless_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database that exists and has no ledger tables."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/empty.db"
        return
    check_postgres()
    with scratch_database() as url:
        yield url


def test_a_database_without_the_schema_raises_schema_missing(schemaless_url: str) -> None:
    ledger = Ledger(schemaless_url)
    try:
        # SQLAlchemy Core (engine.transaction), then the admission path
        with pytest.raises(SchemaMissing) as caught:
            ledger.budgets()
        with pytest.raises(SchemaMissing):
            ledger.calls.reserve("acme", "call-1", 10)
        # the hot path's statements on the driver connection (statements.Driver)
        with pytest.raises(SchemaMissing), Driver(ledger.engine).transaction() as cur:
            cur.one("SELECT id FROM budgets WHERE name = :name", {"name": "acme"})
    finally:
        ledger.dispose()
    assert isinstance(caught.value, LedgerUnavailable)  # callers still fail closed
    assert str(caught.value).startswith("the ledger schema is missing or out of date (")
    assert str(caught.value).endswith("): run `budget-tasks db upgrade`")


def test_a_sqlite_ledger_locked_by_another_writer_is_unavailable_not_a_type_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds SQLite's write lock past the busy timeout: BEGIN IMMEDIATE
    fails, and the ledger says it is unavailable (fail closed: the task retries), as
    for any database it cannot reach. It raised TypeError from its own error check."""
    import sqlite3

    from budget_tasks.ledger import engine

    monkeypatch.setattr(engine, "SQLITE_BUSY_TIMEOUT_S", 0.2)
    path = tmp_path / "ledger.db"
    ledger = Ledger(f"sqlite:///{path}")
    ledger.create_schema()
    ledger.create_budget("team", 100)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(LedgerUnavailable, match="locked"):
            ledger.calls.reserve("team", "k", 10)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert ledger.calls.reserve("team", "k", 10).created  # once the lock is gone
    ledger.dispose()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@/ledger?host=db1:5432&host=db2:5433&target_session_attrs=read-write",
        "postgresql://u@/ledger?host=db1,db2&port=5432,5433&target_session_attrs=read-write",
        # as failover tools print it (pg_autoctl show uri): libpq's list in the netloc
        "postgres://u@db1:5432,db2:5433/ledger?target_session_attrs=read-write",
    ],
)
def test_a_multi_host_ledger_url_reaches_psycopg_whole(url: str) -> None:
    """A failover cluster's URL names every server and asks for the one that takes
    writes: the ledger passes all of it to libpq (see README, "Many hosts")."""
    from budget_tasks.ledger.engine import build_engine

    engine = build_engine(url)
    try:
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        params = {**dict(enumerate(args)), **kwargs}
        assert engine.url.drivername == "postgresql+psycopg"
        assert params["host"] == "db1,db2"
        assert params["port"] == "5432,5433"
        assert params["target_session_attrs"] == "read-write"
    finally:
        engine.dispose()
