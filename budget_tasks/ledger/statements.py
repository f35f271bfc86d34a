"""The hot path's SQL, run on the driver connection without expression building.

reserve, mark_sending and settle run thousands of times a second across a fleet;
building SQLAlchemy expressions for each call cost more than the database round
trips, so these few statements are plain parameterised SQL, written once with
``:name`` placeholders and translated to the driver's style. Everything else in the
ledger uses SQLAlchemy Core.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from ..errors import LedgerUnavailable

#: The one expression for money still available in a period row. Admission, refusal
#: messages and balance reports all use it (invariant 10).
AVAILABLE = "(cap - spent - held)"

INSERT_ATTEMPT = """
INSERT INTO attempts (key, budget_id, period_id, fingerprint, reason, amount, state, created_at)
VALUES (:key, :budget_id, :period_id, :fingerprint, :reason, :amount, 'reserved', :now)
ON CONFLICT (key) DO NOTHING
RETURNING id"""

# Check and write in one statement: the row lock taken by the UPDATE makes the check
# and the increment one atomic step, and the frozen flag is read in the same statement.
ADMIT = f"""
UPDATE budget_periods SET held = held + :amount
WHERE id = :period_id
  AND {AVAILABLE} >= :amount
  AND budget_id IN (SELECT id FROM budgets WHERE frozen = :false)
RETURNING id"""

REFUSAL = f"""
SELECT {AVAILABLE}, (SELECT frozen FROM budgets WHERE budgets.id = budget_id)
FROM budget_periods WHERE id = :period_id"""

EXISTING_ATTEMPT = """
SELECT b.name, a.amount, a.fingerprint, a.state, a.reason, p.period_start
FROM attempts a
JOIN budgets b ON b.id = a.budget_id
JOIN budget_periods p ON p.id = a.period_id
WHERE a.key = :key"""

INSERT_JOURNAL = """
INSERT INTO journal (attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at)
VALUES (:attempt_id, :period_id, :kind, :held_delta, :spent_delta, :note, :ref, :now)"""

MARK_SENDING = """
UPDATE attempts
SET state = 'sending', sending_at = :now,
    provider = COALESCE(:provider, provider), request_id = COALESCE(:request_id, request_id)
WHERE key = :key AND state = 'reserved'
RETURNING id"""

ATTEMPT_STATE = "SELECT state FROM attempts WHERE key = :key"

LOCK_ATTEMPT = """
SELECT id, amount, actual, state FROM attempts WHERE key = :key{for_update}"""

HELD_PERIODS = """
SELECT j.period_id FROM journal j JOIN budget_periods p ON p.id = j.period_id
WHERE j.attempt_id = :attempt_id AND j.kind = 'hold'
ORDER BY p.budget_id"""

APPLY_SETTLEMENT = """
UPDATE budget_periods SET held = held - :amount, spent = spent + :actual
WHERE id = :period_id"""

RESOLVE_ATTEMPT = """
UPDATE attempts SET state = :state, actual = :actual, resolved_at = :now,
    note = COALESCE(:note, note)
WHERE id = :attempt_id"""

BALANCE = f"""
SELECT cap, spent, held, {AVAILABLE} FROM budget_periods WHERE id = :period_id"""

_NAMED = re.compile(r"(?<!:):(\w+)")


class Driver:
    """Runs the statements above on one backend's driver."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sqlite = engine.dialect.name == "sqlite"
        self._sql: dict[str, str] = {}

    def sql(self, statement: str) -> str:
        """The statement in the driver's placeholder style (cached)."""
        translated = self._sql.get(statement)
        if translated is None:
            translated = statement.replace("{for_update}", "" if self.sqlite else " FOR UPDATE")
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

    @contextmanager
    def transaction(self) -> Iterator[Cursor]:
        """One transaction on a pooled driver connection; failures to reach the
        database become LedgerUnavailable, and the transaction rolls back."""
        dbapi = self.engine.dialect.dbapi
        assert dbapi is not None
        unreachable = (dbapi.OperationalError, dbapi.InterfaceError)
        try:
            conn = self.engine.raw_connection()
        except DBAPIError as exc:
            raise LedgerUnavailable(_first_line(exc.orig or exc)) from exc
        try:
            cursor = Cursor(self, conn.cursor())
            if self.sqlite:
                cursor.raw.execute("BEGIN IMMEDIATE")
            yield cursor
            conn.commit()
        except unreachable as exc:
            conn.invalidate(exc)
            raise LedgerUnavailable(_first_line(exc)) from exc
        except BaseException:
            try:
                conn.rollback()
            except unreachable as exc:
                conn.invalidate(exc)
            raise
        finally:
            conn.close()


class Cursor:
    """A driver cursor that takes the statements above and ``:name`` parameters."""

    def __init__(self, driver: Driver, raw: Any) -> None:
        self.driver = driver
        self.raw = raw

    def one(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        self.raw.execute(self.driver.sql(statement), params)
        row: tuple[Any, ...] | None = self.raw.fetchone()
        return row

    def all(self, statement: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        self.raw.execute(self.driver.sql(statement), params)
        return list(self.raw.fetchall())

    def run(self, statement: str, params: Mapping[str, Any]) -> int:
        self.raw.execute(self.driver.sql(statement), params)
        return int(self.raw.rowcount)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
