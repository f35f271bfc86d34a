"""Operations: one business intent per idempotency key, with a lease while a worker runs
it and its stored outcome, so that a redelivery replays instead of resending.

The decisions here are the task flow of DESIGN.md, made in one transaction with the
operation row locked: replay a success, report a failure again, wait for a live lease,
stop a poison message, or take the lease and say what the last attempt left behind.
"""

from __future__ import annotations

import enum
import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from .. import _validate as check
from ..errors import IdempotencyConflict, UnknownOperation
from . import statements as sql
from .statements import Cursor, Driver

_HOST = socket.gethostname()


class Decision(enum.Enum):
    RUN = "run"  # the lease is ours: go on
    REPLAY = "replay"  # succeeded before: return the stored result
    FAILED = "failed"  # failed for good before: report the stored error
    IN_PROGRESS = "in_progress"  # another worker holds a live lease: retry later
    POISONED = "poisoned"  # too many runs died: stop this message


@dataclass(frozen=True, slots=True)
class LastAttempt:
    key: str
    state: str
    amount: int
    reason: str


@dataclass(frozen=True, slots=True)
class OperationStart:
    """What a delivery found, and the lease if it took one."""

    decision: Decision
    operation_id: int
    key: str
    result: Any = None
    error: str | None = None
    runs: int = 0
    lease_expires_at: datetime | None = None
    #: the latest main-call attempt, if any, and how many there were
    last_attempt: LastAttempt | None = None
    attempts: int = 0
    next_reason: str | None = None


def owner_id() -> str:
    """Who holds a lease: this host and process, plus a token unique to the delivery."""
    return f"{_HOST}:{os.getpid()}:{os.urandom(4).hex()}"


def lease_is_live(owner: str | None, expires: datetime | None, now: datetime) -> bool:
    """A lease is live until it expires, unless its process, on this host, is gone."""
    if owner is None or expires is None or expires <= now:
        return False
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host == _HOST and pid_text.isdigit():
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            return False  # a killed worker: its lease dies with it
        except PermissionError:
            return True
    return True


class _LedgerBase(Protocol):
    _driver: Driver

    def now(self) -> datetime: ...


class OperationsMixin:
    """The operation methods of :class:`~budget_tasks.Ledger`."""

    def begin_operation(
        self: _LedgerBase,
        key: str,
        *,
        fingerprint: str,
        owner: str,
        lease: timedelta,
        max_runs: int,
        task: str | None = None,
        payload: Any = None,
    ) -> OperationStart:
        """Record a delivery of ``key`` and decide what it may do (see :class:`Decision`)."""
        check.text(key, "idempotency key")
        check.text(fingerprint, "fingerprint")
        check.text(owner, "lease owner")
        check.duration(lease, "lease")
        check.positive(max_runs, "max_runs")
        check.optional_text(task, "task name")
        now = self.now()
        stamp = self._driver.ts(now)
        with self._driver.transaction() as cur:
            cur.run(
                sql.INSERT_OPERATION,
                {
                    "key": key,
                    "fingerprint": fingerprint,
                    "task": task,
                    "payload": None if payload is None else json.dumps(payload, default=repr),
                    "now": stamp,
                },
            )
            row = cur.one(sql.LOCK_OPERATION, {"key": key})
            assert row is not None
            op_id, recorded_fp, status, result, error, lease_owner, expires, runs, nxt = row
            if recorded_fp != fingerprint:
                raise IdempotencyConflict(key, "fingerprint", recorded_fp, fingerprint)
            expires_at = None if expires is None else self._driver.from_ts(expires)

            def delivered(decision: Decision, **facts: Any) -> OperationStart:
                replay = 1 if decision is Decision.REPLAY else 0
                cur.run(sql.COUNT_DELIVERY, {"replay": replay, "now": stamp, "operation_id": op_id})
                return OperationStart(decision, op_id, key, runs=runs, **facts)

            if status == "succeeded":
                # A result purged after its retention replays as None.
                return delivered(
                    Decision.REPLAY, result=None if result is None else json.loads(result)
                )
            if status == "failed":
                return delivered(Decision.FAILED, error=error)
            if lease_is_live(lease_owner, expires_at, now) and lease_owner != owner:
                return delivered(Decision.IN_PROGRESS, lease_expires_at=expires_at)
            if runs >= max_runs:
                error = f"poison message: {runs} runs of {key!r} never finished"
                cur.run(
                    sql.END_OPERATION,
                    {
                        "status": "failed",
                        "result": None,
                        "error": error,
                        "next_reason": None,
                        "now": stamp,
                        "completed_at": stamp,
                        "key": key,
                        "run_ended": 0,  # the dead runs stay counted
                    },
                )
                return delivered(Decision.POISONED, error=error)
            attempts = cur.all(sql.LAST_ATTEMPT, {"operation_id": op_id})
            last = LastAttempt(*attempts[0]) if attempts else None
            expires_new = now + lease
            cur.run(
                sql.TAKE_LEASE,
                {
                    "owner": owner,
                    "expires": self._driver.ts(expires_new),
                    "now": stamp,
                    "operation_id": op_id,
                },
            )
            return OperationStart(
                Decision.RUN,
                op_id,
                key,
                runs=runs + 1,
                lease_expires_at=expires_new,
                last_attempt=last,
                attempts=len(attempts),
                next_reason=nxt,
            )

    def finish_operation(
        self: Any,
        key: str,
        *,
        result: Any,
        settlements: Sequence[tuple[str, int, bool]] = (),
    ) -> None:
        """Settle ``(attempt key, actual, estimate_only)`` for each attempt and store the
        operation's result, in one transaction: a later delivery replays it."""
        check.text(key, "idempotency key")
        encoded = json.dumps(result)
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            resolutions = [
                self._resolve_in(
                    cur, akey, actual, "settled", "charge", None, stamp, estimate_only=estimate_only
                )
                for akey, actual, estimate_only in settlements
            ]
            _end(cur, key, "succeeded", stamp, result=encoded)
            for resolution in resolutions:
                resolution.apply(cur)
        for resolution in resolutions:
            if resolution.applied and resolution.actual > resolution.amount:
                self._log_overrun(key, resolution.amount, resolution.actual)

    def end_operation(
        self: _LedgerBase,
        key: str,
        status: str,
        *,
        error: str | None = None,
        next_reason: str | None = None,
        result: Any = None,
        owner: str | None = None,
    ) -> bool:
        """Give the lease back and record where the operation stands.

        With ``owner``, only while that owner still holds the lease: returns False (and
        changes nothing) once it does not. Without, an unknown key raises.
        """
        if status not in ("pending", "failed", "unknown", "retryable", "succeeded"):
            raise ValueError(f"an operation cannot end as {status!r}")
        check.text(key, "idempotency key")
        check.optional_text(owner, "lease owner")
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            encoded = None if result is None else json.dumps(result)
            if not _end(
                cur,
                key,
                status,
                stamp,
                error=error,
                next_reason=next_reason,
                result=encoded,
                owner=owner,
            ):
                if owner is not None:
                    return False
                raise UnknownOperation(key)
        return True

    def side_effect(self: _LedgerBase, operation_id: int, name: str) -> tuple[str, Any] | None:
        """``(state, result)`` of a side effect, or None if it never started."""
        with self._driver.transaction() as cur:
            row = cur.one(sql.SIDE_EFFECT, {"operation_id": operation_id, "name": name})
        if row is None:
            return None
        state, result = row
        return state, None if result is None else json.loads(result)

    def start_side_effect(self: _LedgerBase, operation_id: int, name: str) -> bool:
        """Claim the side effect; False if it was claimed before (done or not)."""
        check.text(name, "side effect name")
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            row = cur.one(
                sql.START_SIDE_EFFECT,
                {"operation_id": operation_id, "name": name, "now": stamp},
            )
        return row is not None

    def finish_side_effect(self: _LedgerBase, operation_id: int, name: str, result: Any) -> None:
        encoded = json.dumps(result)
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            cur.run(
                sql.FINISH_SIDE_EFFECT,
                {"operation_id": operation_id, "name": name, "result": encoded, "now": stamp},
            )

    def forget_side_effect(self: _LedgerBase, operation_id: int, name: str) -> None:
        """Drop a claim whose function raised, so that a later run may try again."""
        with self._driver.transaction() as cur:
            cur.run(sql.FORGET_SIDE_EFFECT, {"operation_id": operation_id, "name": name})


def _end(
    cur: Cursor,
    key: str,
    status: str,
    stamp: Any,
    *,
    error: str | None = None,
    next_reason: str | None = None,
    result: str | None = None,
    owner: str | None = None,
) -> bool:
    done = status in ("succeeded", "failed")
    params = {
        "status": status,
        "result": result,
        "error": error,
        "next_reason": next_reason,
        "now": stamp,
        "completed_at": stamp if done else None,
        "key": key,
        "run_ended": 1,
    }
    if owner is None:
        return bool(cur.run(sql.END_OPERATION, params))
    return bool(cur.run(sql.END_OWN_OPERATION, {**params, "owner": owner}))
