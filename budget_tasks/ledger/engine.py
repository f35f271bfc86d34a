"""Engine construction per backend, and the one mapping of database failures to
:class:`~budget_tasks.errors.LedgerUnavailable` (fail closed), of a missing table to
:class:`~budget_tasks.errors.SchemaMissing`, and of a bad URL to
:class:`~budget_tasks.errors.LedgerConfigError`."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from typing import Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    NoSuchModuleError,
)

from ..errors import LedgerConfigError, LedgerUnavailable, SchemaMissing

SQLITE_BUSY_TIMEOUT_S = 30.0
PG_CONNECT_TIMEOUT_S = 5
#: PostgreSQL's SQLSTATE undefined_table.
UNDEFINED_TABLE = "42P01"
URL_EXAMPLES = "postgresql://USER@HOST:5432/DBNAME or sqlite:///PATH/ledger.db"


#: libpq's multi-host form, ``scheme://[user@]h1:p1,h2:p2/db?...``, as failover
#: tools print it (``pg_autoctl show uri``): SQLAlchemy reads no comma in the host.
_HOST_LIST = re.compile(
    r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://(?:[^@/?]*@)?)(?P<hosts>[^@/?]*,[^@/?]*)(?P<tail>[/?].*)?$"
)


def _hosts_as_query(url: str) -> str:
    """libpq's ``h1:p1,h2:p2`` host list as SQLAlchemy's ``?host=h1:p1&host=h2:p2``,
    which it hands to libpq as the same list; any other URL as it is."""
    found = _HOST_LIST.match(url)
    if found is None:
        return url
    path, _, query = (found["tail"] or "/").partition("?")
    hosts = "&".join(f"host={quote(h, safe=':[]')}" for h in found["hosts"].split(","))
    return f"{found['head']}{path}?{hosts}" + (f"&{query}" if query else "")


def normalise_url(url: str) -> str:
    """Accept ``postgresql://`` and ``postgres://`` and use psycopg 3 for them; a
    failover cluster's hosts may be listed as libpq lists them (``h1:p1,h2:p2``).

    A URL that does not parse raises LedgerConfigError (its text is not repeated: it may
    hold a password)."""
    if not url:
        raise LedgerConfigError(f"it is empty; expected {URL_EXAMPLES}")
    try:
        parsed = make_url(_hosts_as_query(url))
    except ArgumentError as exc:
        raise LedgerConfigError(f"it does not parse; expected {URL_EXAMPLES}") from exc
    except ValueError as exc:  # SQLAlchemy's int() of the port
        raise LedgerConfigError("its port is not a number") from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise LedgerConfigError(
            f"the ledger runs on PostgreSQL or SQLite, not {parsed.drivername!r}"
        )
    return parsed.render_as_string(hide_password=False)


def build_engine(url: str, **options: Any) -> Engine:
    url = normalise_url(url)
    try:
        if url.startswith("sqlite"):
            engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S}, **options)
            _sqlite_serialised_writes(engine)
            _sqlite_private_file(engine)
            return engine
        options.setdefault("pool_size", 2)
        options.setdefault("max_overflow", 8)
        engine = create_engine(
            url,
            connect_args={
                "connect_timeout": PG_CONNECT_TIMEOUT_S,
                "application_name": "budget-tasks",
            },
            **options,
        )
        _postgresql_session(engine)
        return engine
    except (ImportError, NoSuchModuleError) as exc:  # e.g. postgresql+asyncpg://
        driver = make_url(url).drivername
        raise LedgerConfigError(f"no driver for {driver!r} is installed: {exc}") from exc


#: What each ledger session on PostgreSQL sets first. Every ledger query reads a few rows
#: by index from a working set that is cached; planned with the server's default
#: random_page_cost (4, a spinning disk's), reports and the audit hash-joined whole
#: history tables instead (holds() read every operation ever made: 2.5x at 200,000
#: calls). Set on the session, not sent as a startup option, which PgBouncer refuses.
PG_SESSION = ("SET random_page_cost = 1.1",)


def _postgresql_session(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _settings(dbapi_connection: Any, _record: Any) -> None:
        with dbapi_connection.cursor() as cur:
            for statement in PG_SESSION:
                cur.execute(statement)
        dbapi_connection.commit()


def _sqlite_private_file(engine: Engine) -> None:
    """Make a new SQLite ledger readable by its owner only: its folder 0700 and the
    file 0600 (SQLite gives its journal files the file's own mode). The ledger holds
    prompts, answers and spend; the process umask would leave them readable by every
    local user. A file that exists is left as it is."""
    path = engine.url.database or ""
    if path in ("", ":memory:") or path.startswith("file:"):
        return

    @event.listens_for(engine, "do_connect")
    def _private(dialect: Any, record: Any, cargs: Any, cparams: Any) -> None:
        if os.path.exists(path):
            return
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            os.makedirs(folder, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process made it first
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def _sqlite_serialised_writes(engine: Engine) -> None:
    """Make every SQLite transaction take the write lock at BEGIN.

    pysqlite's deferred BEGIN lets two transactions read, then both try to upgrade to
    a write lock and one fails with SQLITE_BUSY. BEGIN IMMEDIATE serialises them
    instead, which is what admission needs.
    """

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def schema_missing(exc: BaseException) -> bool:
    """Whether a database error (the driver's, or SQLAlchemy's wrapping it) says a table
    does not exist: read off the failure, so that no call pays a query to check."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    if getattr(exc, "sqlstate", None) == UNDEFINED_TABLE:  # psycopg
        return True
    return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith("no such table")


def unavailable(exc: BaseException) -> LedgerUnavailable:
    """The typed error for a database failure: SchemaMissing for a missing table."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    text = str(exc).strip()
    detail = text.splitlines()[0] if text else type(exc).__name__
    return SchemaMissing(detail) if schema_missing(exc) else LedgerUnavailable(detail)
