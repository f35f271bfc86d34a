"""The hot path's SQL, run on the driver connection without expression building.

reserve, mark_sending and settle run thousands of times a second across a fleet;
building SQLAlchemy expressions for each call cost more than the database round
trips, so these few statements are plain parameterised SQL, written once with
``:name`` placeholders and translated to the driver's style. Everything else in the
ledger uses SQLAlchemy Core.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ..errors import LedgerUnavailable
from .engine import schema_missing, unavailable

#: The one expression for money still available in a period row. Admission, refusal
#: messages and balance reports all use it (invariant 10).
AVAILABLE = "(cap - spent - held)"

#: A new attempt, reserved; or, admitted and granted in one transaction, already
#: sending and described (what the call is, for reconciliation).
INSERT_ATTEMPT = """
INSERT INTO attempts
    (key, budget_id, period_id, fingerprint, reason, amount, price_version, operation_id,
     label, step, state, created_at, sending_at, lookup, model, timeout_ms)
VALUES
    (:key, :budget_id, :period_id, :fingerprint, :reason, :amount, :price_version,
     :operation_id, :label, :step, :state, :now, :sending_at, :lookup, :model,
     CAST(:timeout_ms AS BIGINT))
ON CONFLICT (key) DO NOTHING
RETURNING id"""

# Check and write in one statement: the row lock taken by the UPDATE makes the check
# and the increment one atomic step, and the frozen flag is read in the same statement.
# A closed period admits nothing: what it left unused may have been carried already.
ADMIT = f"""
UPDATE budget_periods SET held = held + :amount
WHERE id = :period_id
  AND {AVAILABLE} >= :amount
  AND closed_at IS NULL
  AND budget_id IN (SELECT id FROM budgets WHERE frozen = :false)
RETURNING id"""

REFUSAL = f"""
SELECT {AVAILABLE}, (SELECT frozen FROM budgets WHERE budgets.id = budget_id), closed_at
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

#: Written while a call is out (what it is, its request id): on the hot path, so
#: prebuilt here rather than through SQLAlchemy Core, which pings per transaction.
DESCRIBE_ATTEMPT = """
UPDATE attempts SET lookup = COALESCE(:lookup, lookup), model = COALESCE(:model, model),
    response_id = COALESCE(:response_id, response_id),
    timeout_ms = COALESCE(CAST(:timeout_ms AS BIGINT), timeout_ms)
WHERE key = :key"""

RECORD_REQUEST_ID = """
UPDATE attempts SET request_id = :request_id
WHERE key = :key AND request_id IS NULL AND state <> 'reserved'
RETURNING id"""

ATTEMPT_REQUEST_ID = "SELECT state, request_id FROM attempts WHERE key = :key"

# The attempt row, locked, with each period row it holds: one row per period, in the
# order reserve locked them (budget id), so settlement takes locks in the same order.
LOCK_ATTEMPT = """
SELECT a.id, a.amount, a.actual, a.state, a.recorded_actual, j.period_id
FROM attempts a
JOIN journal j ON j.attempt_id = a.id AND j.kind = 'hold'
JOIN budget_periods p ON p.id = j.period_id
WHERE a.key = :key
ORDER BY p.budget_id{for_update}"""

APPLY_SETTLEMENT = f"""
UPDATE budget_periods SET held = held - :amount, spent = spent + :actual,
    overrun = overrun + CASE WHEN :actual > :amount THEN :actual - :amount ELSE 0 END
WHERE id = :period_id
RETURNING carried_out, {AVAILABLE}"""

TAKE_BACK_CARRY = """
UPDATE budget_periods SET carried_out = carried_out - :deficit WHERE id = :period_id"""

#: The period right after the given one, of the same budget: where its carry went. It
#: returns what that period carried on and what it has left, for the next step.
LOWER_NEXT_CAP = f"""
UPDATE budget_periods SET cap = cap - :deficit
WHERE id = (
    SELECT n.id FROM budget_periods n JOIN budget_periods o ON o.budget_id = n.budget_id
    WHERE o.id = :period_id AND n.period_start > o.period_start
    ORDER BY n.period_start LIMIT 1
)
RETURNING id, carried_out, {AVAILABLE}"""

ADJUSTMENT_SEEN = """
SELECT 1 FROM journal WHERE attempt_id = :attempt_id AND ref = :ref"""

# What the attempt has been charged so far in its own budget's period.
ATTEMPT_CHARGED = """
SELECT COALESCE(SUM(j.spent_delta), 0) FROM journal j JOIN attempts a ON a.id = j.attempt_id
WHERE j.attempt_id = :attempt_id AND j.period_id = a.period_id"""

APPLY_ADJUSTMENT = f"""
UPDATE budget_periods SET spent = spent + :delta WHERE id = :period_id
RETURNING carried_out, {AVAILABLE}"""

#: The resolution, with the call's request and response ids when the run kept them
#: for it (written with the settlement: one commit).
RESOLVE_ATTEMPT = """
UPDATE attempts SET state = :state, actual = :actual, resolved_at = :now,
    note = COALESCE(:note, note), estimate_only = :estimate_only,
    answer = COALESCE(:answer, answer),
    request_id = COALESCE(request_id, :request_id),
    response_id = COALESCE(response_id, :response_id)
WHERE id = :attempt_id AND state = :expected"""

#: sending -> unknown, compare-and-set; the usage a run recorded stays as proof of billing.
MARK_UNKNOWN = """
UPDATE attempts SET state = 'unknown', note = :note,
    request_id = COALESCE(request_id, :request_id),
    response_id = COALESCE(response_id, :response_id),
    recorded_actual = CASE WHEN CAST(:recorded AS BIGINT) IS NULL THEN recorded_actual
                           ELSE CAST(:recorded AS BIGINT) END
WHERE key = :key AND state = 'sending'
RETURNING id"""

#: What a finished call reported, in one statement: the request and response ids, and
#: its priced usage added to what the attempt recorded (proof of billing, written as
#: soon as it is known so that no crash after it can drop it).
RECORD_CALL = """
UPDATE attempts SET request_id = COALESCE(request_id, :request_id),
    response_id = COALESCE(:response_id, response_id),
    recorded_actual = CASE WHEN CAST(:cost AS BIGINT) IS NULL THEN recorded_actual
                           ELSE COALESCE(recorded_actual, 0) + CAST(:cost AS BIGINT) END
WHERE key = :key AND state IN ('sending', 'unknown')
RETURNING id"""

BALANCE = f"""
SELECT cap, spent, held, {AVAILABLE} FROM budget_periods WHERE id = :period_id"""

# -- budgets -----------------------------------------------------------------------------

LOCK_BUDGET = """
SELECT id, cap, rollover_ceiling FROM budgets WHERE name = :name{for_update_plain}"""

#: The budget's open period (the latest not closed), locked, with what it has committed.
LOCK_OPEN_PERIOD = """
SELECT id, cap, spent + held FROM budget_periods
WHERE budget_id = :budget_id AND closed_at IS NULL
ORDER BY period_start DESC LIMIT 1{for_update_plain}"""

SET_BUDGET_CAP = "UPDATE budgets SET cap = :cap WHERE id = :budget_id"

MOVE_PERIOD_CAP = "UPDATE budget_periods SET cap = cap + :delta WHERE id = :period_id"

INSERT_CAP_CHANGE = """
INSERT INTO journal (attempt_id, period_id, kind, held_delta, spent_delta, cap_delta, note,
                     created_at)
VALUES (NULL, :period_id, 'cap', 0, 0, :delta, :note, :now)"""

# -- operations --------------------------------------------------------------------------

INSERT_OPERATION = """
INSERT INTO operations
    (key, fingerprint, task, payload, status, runs, deliveries, replays, created_at, updated_at)
VALUES (:key, :fingerprint, :task, :payload, 'pending', 0, 0, 0, :now, :now)
ON CONFLICT (key) DO NOTHING"""

LOCK_OPERATION = """
SELECT id, fingerprint, status, result, error, lease_owner, lease_expires_at, runs,
       next_reason
FROM operations WHERE key = :key{for_update_plain}"""

LOCK_OPERATION_BY_ID = """
SELECT id, fingerprint, status, result, error, lease_owner, lease_expires_at, runs,
       next_reason
FROM operations WHERE id = :operation_id{for_update_plain}"""

#: The operation's main-call attempts, and the latest attempt of each labelled call
#: if it is not resolved, newest first: what a delivery or a conclusion decides from.
#: (An earlier attempt that a later one replaced, a resend, is reconciled on its own.)
OPERATION_ATTEMPTS = """
SELECT a.id, a.key, a.state, a.amount, a.reason, a.label, a.answer, a.recorded_actual
FROM attempts a
WHERE a.operation_id = :operation_id
  AND (a.label IS NULL OR (
        a.state IN ('reserved', 'sending', 'unknown')
        AND NOT EXISTS (SELECT 1 FROM attempts b
                        WHERE b.operation_id = a.operation_id AND b.step = a.step
                          AND b.id > a.id)))
ORDER BY a.id DESC"""

#: The latest attempt of one labelled call, and how many it has had.
STEP_ATTEMPT = """
SELECT key, state, amount, reason, answer, recorded_actual,
       (SELECT COUNT(*) FROM attempts s WHERE s.operation_id = :operation_id AND s.step = :step)
FROM attempts
WHERE operation_id = :operation_id AND step = :step
ORDER BY id DESC LIMIT 1"""

COUNT_DELIVERY = """
UPDATE operations SET deliveries = deliveries + 1, replays = replays + :replay,
    updated_at = :now
WHERE id = :operation_id"""

#: A delivery of a finished key, in one statement: counted, and its stored result read.
REPLAY = """
UPDATE operations SET deliveries = deliveries + 1, replays = replays + 1, updated_at = :now
WHERE key = :key AND fingerprint = :fingerprint AND status = 'succeeded'
RETURNING id, result, runs"""

#: A first delivery: the operation recorded with this delivery's lease, in one statement.
INSERT_RUNNING_OPERATION = """
INSERT INTO operations
    (key, fingerprint, task, payload, status, lease_owner, lease_expires_at, runs,
     deliveries, replays, created_at, updated_at)
VALUES (:key, :fingerprint, :task, :payload, 'running', :owner, :expires, 1, 1, 0, :now, :now)
ON CONFLICT (key) DO NOTHING
RETURNING id"""

#: A delivery whose admission was refused (the budget): its transaction rolled back, so
#: the operation is recorded here, pending, with why; an operation another delivery
#: moved meanwhile (compare-and-set on the statuses a delivery may be refused from) only
#: counts the delivery.
RECORD_REFUSAL = """
INSERT INTO operations
    (key, fingerprint, task, payload, status, error, runs, deliveries, replays, created_at,
     updated_at)
VALUES (:key, :fingerprint, :task, :payload, 'pending', :error, 0, 1, 0, :now, :now)
ON CONFLICT (key) DO UPDATE SET deliveries = operations.deliveries + 1,
    updated_at = excluded.updated_at,
    error = CASE WHEN operations.status IN ('pending', 'retryable') THEN excluded.error
                 ELSE operations.error END,
    next_reason = CASE WHEN operations.status IN ('pending', 'retryable') THEN NULL
                       ELSE operations.next_reason END,
    status = CASE WHEN operations.status = 'retryable' THEN 'pending'
                  ELSE operations.status END"""

TAKE_LEASE = """
UPDATE operations SET status = 'running', lease_owner = :owner, lease_expires_at = :expires,
    runs = runs + 1, deliveries = deliveries + 1, updated_at = :now
WHERE id = :operation_id"""

#: Move an operation from the status (and lease owner) its writer read to another, and
#: give the lease back. ``runs`` counts runs that took the lease and never recorded
#: their end (what poison detection counts): a run ending itself (``run_ended``) is
#: taken off it. SET expressions read the row as it was.
SET_OPERATION = """
UPDATE operations SET status = :status, result = COALESCE(:result, result),
    error = :error, next_reason = :next_reason, lease_owner = NULL,
    lease_expires_at = NULL, updated_at = :now, completed_at = :completed_at,
    runs = CASE WHEN :run_ended = 1 AND runs > 0 THEN runs - 1 ELSE runs END
WHERE id = :operation_id AND status = :expected
  AND COALESCE(lease_owner, '') = COALESCE(:expected_owner, '')"""

START_SIDE_EFFECT = """
INSERT INTO side_effects (operation_id, name, state, created_at)
VALUES (:operation_id, :name, 'started', :now)
ON CONFLICT (operation_id, name) DO NOTHING
RETURNING id"""

SIDE_EFFECT = """
SELECT state, result FROM side_effects WHERE operation_id = :operation_id AND name = :name"""

FINISH_SIDE_EFFECT = """
UPDATE side_effects SET state = 'done', result = :result, completed_at = :now
WHERE operation_id = :operation_id AND name = :name"""

#: Where an attempt sits in its operation, and whether it is still the latest attempt
#: of its call (the main call, or one labelled call).
ATTEMPT_POSITION = """
SELECT a.operation_id, o.key, a.label, a.state,
    CASE WHEN EXISTS (
        SELECT 1 FROM attempts b
        WHERE b.operation_id = a.operation_id AND b.id > a.id
          AND ((a.label IS NULL AND b.label IS NULL) OR (a.step IS NOT NULL AND b.step = a.step))
    ) THEN 0 ELSE 1 END
FROM attempts a LEFT JOIN operations o ON o.id = a.operation_id
WHERE a.key = :key"""

#: Attempts held by runs that may be gone: open (sending) or never granted (reserved),
#: under an operation, with that operation's lease to check.
ORPHAN_CANDIDATES = """
SELECT a.key, a.state, o.key, o.lease_owner, o.lease_expires_at, o.status
FROM attempts a JOIN operations o ON o.id = a.operation_id
WHERE a.state IN ('reserved', 'sending')
ORDER BY a.id
LIMIT :limit"""

STORE_SIDE_EFFECT = """
INSERT INTO side_effects (operation_id, name, state, result, created_at, completed_at)
VALUES (:operation_id, :name, 'done', :result, :now, :now)
ON CONFLICT (operation_id, name) DO UPDATE
SET state = 'done', result = excluded.result, completed_at = excluded.completed_at"""

RENEW_LEASE = """
UPDATE operations SET lease_expires_at = :expires, deliveries = deliveries + 1,
    updated_at = :now
WHERE id = :operation_id"""

FORGET_SIDE_EFFECT = """
DELETE FROM side_effects WHERE operation_id = :operation_id AND name = :name
  AND state = 'started'"""

_NAMED = re.compile(r"(?<!:):(\w+)")


class Driver:
    """Runs the statements above on one backend's driver.

    Each transaction checks a driver connection out of the engine's pool and gives it
    back when it ends, so connections belong to the unit of work that uses them: a
    thread that ends (a metrics scrape, a thread-pool task) holds none. A forked child
    (Celery prefork) never touches what it inherited: see :func:`forget_after_fork`.
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
        self._sql: dict[str, str] = {}
        _engines.add(engine)

    def sql(self, statement: str) -> str:
        """The statement in the driver's placeholder style (cached)."""
        translated = self._sql.get(statement)
        if translated is None:
            lock = "" if self.sqlite else " FOR UPDATE OF a"
            plain = "" if self.sqlite else " FOR UPDATE"
            translated = statement.replace("{for_update}", lock).replace(
                "{for_update_plain}", plain
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

    def checkout(self) -> Any:
        """A driver connection from the pool; the caller gives it back (``close()``)."""
        try:
            return self.engine.raw_connection()
        except PoolTimeout as exc:
            raise LedgerUnavailable(f"no free ledger connection: {_first_line(exc)}") from exc
        except DBAPIError as exc:
            raise LedgerUnavailable(_first_line(exc.orig or exc)) from exc
        except self.unreachable as exc:  # raw_connection() does not always wrap these
            raise LedgerUnavailable(_first_line(exc)) from exc

    def begin(self, conn: Any) -> None:
        if self.sqlite:
            conn.cursor().execute("BEGIN IMMEDIATE")

    @contextmanager
    def transaction(self) -> Iterator[Cursor]:
        """One transaction on a connection of its own from the pool, given back when it
        ends; failures to reach the database become LedgerUnavailable (a missing table,
        SchemaMissing), and the transaction rolls back."""
        conn = self.checkout()
        try:
            try:
                cursor = Cursor(self, conn)
            except self.unreachable as exc:
                conn.invalidate(exc)
                raise LedgerUnavailable(_first_line(exc)) from exc
            try:
                yield cursor
                cursor.conn.commit()
            except self.unreachable as exc:  # SQLite's "no such table" is one too
                cursor.conn.invalidate(exc)
                raise unavailable(exc) from exc
            except BaseException as exc:
                if cursor.conn.is_valid:
                    try:
                        cursor.conn.rollback()
                    except self.unreachable as lost:
                        cursor.conn.invalidate(lost)
                if schema_missing(exc):  # PostgreSQL's UndefinedTable, a ProgrammingError
                    raise unavailable(exc) from exc
                raise
            finally:
                conn = cursor.conn  # a stale connection may have been replaced
        finally:
            with suppress(Exception):
                conn.close()  # back to the pool (an invalidated one is discarded)

    def close(self) -> None:
        """Nothing is kept between transactions: kept for callers of earlier versions."""


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
    """A driver cursor that takes the statements above and ``:name`` parameters."""

    def __init__(self, driver: Driver, conn: Any) -> None:
        self.driver = driver
        self.conn = conn
        driver.begin(conn)
        self.raw = conn.cursor()
        self._first = not driver.sqlite

    def _execute(self, statement: str, params: Mapping[str, Any]) -> None:
        sql = self.driver.sql(statement)
        if self._first:
            self._first = False
            try:
                self.raw.execute(sql, params)
                return
            except self.driver.unreachable as exc:
                # Nothing has run in this transaction yet, so a connection that went
                # stale (a database restart) is replaced once: this stands in for a
                # ping on every checkout, which would cost a round trip per call. The
                # pooled ones are as old, so the pool is renewed too.
                self.conn.invalidate(exc)
                with suppress(Exception):
                    self.conn.close()
                self.driver.engine.dispose()
                self.conn = self.driver.checkout()
                self.raw = self.conn.cursor()
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
