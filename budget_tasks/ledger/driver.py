"""The ledger's one data-access layer: every transaction, on one connection of its own
from the engine's pool, runs named SQL (:mod:`.statements`) and SQLAlchemy Core
statements alike; one place maps failures to LedgerUnavailable and replaces a
connection gone stale.
"""

from __future__ import annotations

import os
import re
import select
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from typing import Any, TypeVar, overload

from sqlalchemy import Connection, CursorResult, Engine, Executable
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.sql.selectable import TypedReturnsRows

from ..errors import LedgerUnavailable
from .engine import schema_missing, unavailable

_NAMED = re.compile(r"(?<!:):(\w+)")
#: PostgreSQL's SQLSTATEs for a transaction aborted to break a deadlock, and for a lock
#: not granted within lock_timeout.
DEADLOCK = "40P01"
LOCK_NOT_AVAILABLE = "55P03"
_Row = TypeVar("_Row", bound=tuple[Any, ...])


class Driver:
    """Runs the ledger's transactions on one engine.

    Each transaction checks a connection out of the engine's pool and gives it back
    when it ends, so connections belong to the unit of work that uses them: a thread
    that ends (a metrics scrape, a thread-pool task) holds none. A forked child (Celery
    prefork) never touches what it inherited: see :func:`forget_after_fork`.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sqlite = engine.dialect.name == "sqlite"
        dbapi = engine.dialect.dbapi
        assert dbapi is not None
        self.unreachable: tuple[type[Exception], ...] = (
            dbapi.OperationalError,
            dbapi.InterfaceError,
        )
        self.integrity: type[Exception] = dbapi.IntegrityError
        self.error: type[Exception] = dbapi.Error
        self.failures: tuple[type[Exception], ...] = (DBAPIError, *self.unreachable)
        self._sql: dict[str, str] = {}
        _engines.add(engine)

    def sql(self, statement: str) -> str:
        """The statement in the driver's placeholder style (cached)."""
        translated = self._sql.get(statement)
        if translated is None:
            lock = "" if self.sqlite else " FOR UPDATE OF a"
            plain = "" if self.sqlite else " FOR UPDATE"
            skip = "" if self.sqlite else " FOR UPDATE SKIP LOCKED"
            translated = (
                statement.replace("{for_update}", lock)
                .replace("{for_update_plain}", plain)
                .replace("{for_update_skip_locked}", skip)
            )
            if not self.sqlite:  # psycopg: pyformat
                translated = _NAMED.sub(r"%(\1)s", translated)
            self._sql[statement] = translated
        return translated

    def ts(self, value: datetime) -> Any:
        """A timestamp parameter, stored as SQLAlchemy's UTCDateTime stores it."""
        value = value.astimezone(UTC)
        if self.sqlite:
            return value.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
        return value

    def from_ts(self, value: Any) -> datetime:
        """A timestamp read by the driver, as an aware UTC datetime."""
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    def checkout(self) -> Connection:
        """A connection from the pool, its transaction begun (SQLite: BEGIN IMMEDIATE,
        by the engine's begin event); the caller gives it back (``close()``)."""
        conn = self._connect()
        try:
            conn.begin()
        except BaseException as exc:
            with suppress(Exception):
                conn.close()
            if isinstance(exc, self.failures):
                raise unavailable(exc) from exc
            raise
        return conn

    @contextmanager
    def transaction(self) -> Iterator[Cursor]:
        """One transaction on a connection of its own from the pool, given back when it
        ends; failures to reach the database become LedgerUnavailable (a missing table,
        SchemaMissing), and the transaction rolls back."""
        cursor = Cursor(self, self.checkout())
        try:
            try:
                yield cursor
                cursor.conn.commit()
            except BaseException as exc:
                if not cursor.conn.invalidated:
                    try:
                        cursor.conn.rollback()
                    except self.failures as lost:
                        with suppress(Exception):
                            cursor.conn.invalidate(lost)
                if _lost(exc, self.unreachable) or schema_missing(exc):
                    if not cursor.conn.invalidated and not schema_missing(exc):
                        with suppress(Exception):
                            cursor.conn.invalidate(exc)
                    raise unavailable(exc) from exc
                raise
        finally:
            with suppress(Exception):
                cursor.conn.close()  # back to the pool (an invalidated one is discarded)

    def call(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """One statement as a transaction of its own (PostgreSQL, autocommit): one round
        trip, no BEGIN or COMMIT sent; its first row.

        Any error the database answers with (a server-side function that declines, a
        deadlock, a function not yet made by the migrations) raises :class:`Declined`:
        the statement wrote nothing, and the caller runs the statement path. A
        connection lost before the answer raises LedgerUnavailable: it may have
        committed, as a COMMIT whose answer was lost."""
        assert not self.sqlite
        conn = self._connect()
        try:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            if _stale(dbapi):
                # A connection the server closed while it sat in the pool (a restart)
                # has the server's goodbye waiting in its socket: replaced before
                # anything is sent, so nothing is sent twice.
                self._drop_stale(conn, None)
                conn = self._connect()
                dbapi = conn.connection.dbapi_connection
                assert dbapi is not None
            dbapi.autocommit = True
            try:
                cursor = dbapi.cursor()
                cursor.execute(self.sql(statement), params)
                row: tuple[Any, ...] | None = cursor.fetchone()
            except self.error as exc:
                sqlstate = getattr(exc, "sqlstate", None)
                if sqlstate is not None:
                    raise Declined(str(sqlstate)) from exc
                with suppress(Exception):
                    conn.invalidate(exc if isinstance(exc, Exception) else None)
                raise unavailable(exc) from exc
            finally:
                with suppress(Exception):
                    dbapi.autocommit = False
            return row
        finally:
            with suppress(Exception):
                conn.close()

    def _drop_stale(self, conn: Connection, exc: BaseException | None) -> None:
        """Discard a connection that went stale (a database restart), and renew the
        pool: the pooled ones are as old."""
        with suppress(Exception):
            conn.invalidate(exc if isinstance(exc, Exception) else None)
        with suppress(Exception):
            conn.close()
        self.engine.dispose()

    def _connect(self) -> Connection:
        try:
            return self.engine.connect()
        except PoolTimeout as exc:
            raise LedgerUnavailable(f"no free ledger connection: {_first_line(exc)}") from exc
        except self.failures as exc:
            raise unavailable(exc) from exc

    def close(self) -> None:
        """Nothing is kept between transactions: kept for callers of earlier versions."""


class Declined(Exception):
    """A statement sent alone was answered with an error (its SQLSTATE): it wrote
    nothing."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def _stale(dbapi: Any) -> bool:
    """Whether an idle connection has something to read: the server closed it."""
    try:
        readable, _, _ = select.select([dbapi.pgconn.socket], [], [], 0)
    except (OSError, ValueError, AttributeError):
        return True
    return bool(readable)


def _lost(exc: BaseException, unreachable: tuple[type[Exception], ...]) -> bool:
    """Whether ``exc`` says the database could not be reached (or the connection broke)."""
    if isinstance(exc, DBAPIError):
        return exc.connection_invalidated or isinstance(exc.orig, unreachable)
    return isinstance(exc, unreachable)


#: Every engine a driver runs on, so that a forked child can forget their connections.
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def forget_after_fork() -> None:
    """In a forked child: drop the pooled connections inherited from the parent without
    closing them (they are the parent's sessions; closing them here would end them
    there). The child opens its own on first use. SQLite's handles the same: its
    documentation forbids carrying a connection across fork."""
    for engine in list(_engines):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=forget_after_fork)


class Cursor:
    """One transaction: named SQL with ``:name`` parameters (``one``, ``all``, ``run``)
    and SQLAlchemy Core statements (``execute``), on the same connection."""

    def __init__(self, driver: Driver, conn: Connection) -> None:
        self.driver = driver
        self.conn = conn
        self.raw = conn.connection.cursor()
        self._first = not driver.sqlite

    def _replace_stale(self, exc: BaseException) -> None:
        # Nothing has run in this transaction yet, so a connection that went stale (a
        # database restart) is replaced once: this stands in for a ping on every
        # checkout, which would cost a round trip per call.
        self.driver._drop_stale(self.conn, exc)
        self.conn = self.driver.checkout()
        self.raw = self.conn.connection.cursor()

    def _first_statement(self) -> bool:
        first, self._first = self._first, False
        return first

    def _execute(self, statement: str, params: Mapping[str, Any]) -> None:
        sql = self.driver.sql(statement)
        if self._first_statement():
            try:
                self.raw.execute(sql, params)
                return
            except self.driver.unreachable as exc:
                self._replace_stale(exc)
        self.raw.execute(sql, params)

    def one(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        self._execute(statement, params)
        row: tuple[Any, ...] | None = self.raw.fetchone()
        return row

    def all(self, statement: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        self._execute(statement, params)
        return list(self.raw.fetchall())

    def run(self, statement: str, params: Mapping[str, Any]) -> int:
        self._execute(statement, params)
        return int(self.raw.rowcount)

    def ddl(self, statement: str) -> None:
        """A statement with no parameters, sent as written (DDL, whose literals may hold
        what would read as a ``:name``)."""
        self._first_statement()
        self.raw.execute(statement)

    @overload
    def execute(
        self, statement: TypedReturnsRows[_Row], params: Mapping[str, Any] | None = None
    ) -> CursorResult[_Row]: ...

    @overload
    def execute(
        self, statement: Executable, params: Mapping[str, Any] | None = None
    ) -> CursorResult[Any]: ...

    def execute(
        self, statement: Executable, params: Mapping[str, Any] | None = None
    ) -> CursorResult[Any]:
        """A SQLAlchemy Core statement, in this transaction."""
        if self._first_statement():
            try:
                return self.conn.execute(statement, params)
            except DBAPIError as exc:
                if not _lost(exc, self.driver.unreachable):
                    raise
                self._replace_stale(exc)
        return self.conn.execute(statement, params)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
