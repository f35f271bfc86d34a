"""What an operator sees of operations and does to them: the list by status, one
operation's whole history (its attempts, their journal, what operators did), and
reopening a failed one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from .. import _validate as check
from ..errors import CannotReopen, UnknownOperation
from . import statements as sql
from .base import _attempt
from .counters import _journal
from .operations import Operations
from .records import Attempt, JournalEntry, Operation, OperationEvent
from .reports import Reports
from .schema import (
    OPERATION_STATUSES,
    attempts,
    budget_periods,
    budgets,
    journal,
    operation_events,
    operations,
)
from .states import HOLDING, OperationStatus

__all__ = ["OperationHistory", "Oversight"]

#: The most operations one listing returns.
MAX_LISTED = 10_000


def operation_of(r: Any) -> Operation:
    """An operations row as an :class:`Operation`."""
    return Operation(
        key=r.key,
        status=r.status,
        task=r.task,
        result=None if r.result is None else json.loads(r.result),
        error=r.error,
        payload=None if r.payload is None else json.loads(r.payload),
        runs=r.runs,
        deliveries=r.deliveries,
        replays=r.replays,
        created_at=r.created_at,
        completed_at=r.completed_at,
        lease_owner=r.lease_owner,
    )


@dataclass(frozen=True, slots=True)
class OperationHistory:
    """One operation with its attempts, their journal entries and operators' events."""

    operation: Operation
    attempts: list[Attempt]
    journal: list[JournalEntry]
    events: list[OperationEvent]


class Oversight(Operations, Reports):
    """The operator's operation methods of :class:`~budget_tasks.Ledger`."""

    def operations(self, *, status: str | None = None, limit: int = 100) -> list[Operation]:
        """Operations, the most recently changed first, optionally in one status."""
        if status is not None and status not in OPERATION_STATUSES:
            raise ValueError(f"status must be one of {OPERATION_STATUSES}, not {status!r}")
        check.positive(limit, "limit")
        query = select(operations).order_by(operations.c.updated_at.desc(), operations.c.id)
        if status is not None:
            query = query.where(operations.c.status == status)
        with self._driver.transaction() as cur:
            rows = cur.execute(query.limit(min(limit, MAX_LISTED))).all()
        return [operation_of(r) for r in rows]

    def actions(self, *, budget: str | None = None, limit: int = 100) -> list[JournalEntry]:
        """What operators did (journal rows naming an actor: resolutions, cap changes,
        adjustments, freezes, unfreezes, reopens), the newest first; optionally in
        one budget's periods."""
        check.positive(limit, "limit")
        query = (
            select(journal, attempts.c.key.label("attempt"), budgets.c.name.label("budget"))
            .outerjoin(attempts, attempts.c.id == journal.c.attempt_id)
            .join(budget_periods, budget_periods.c.id == journal.c.period_id)
            .join(budgets, budgets.c.id == budget_periods.c.budget_id)
            .where(journal.c.actor.is_not(None))
            .order_by(journal.c.id.desc())
            .limit(min(limit, MAX_LISTED))
        )
        if budget is not None:
            name = check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
            query = query.where(budgets.c.name == name)
        with self._driver.transaction() as cur:
            rows = cur.execute(query).all()
        return [_entry(e) for e in rows]

    def operation_history(self, key: str) -> OperationHistory:
        """Operation ``key``, its attempts (oldest first), their journal entries and what
        operators did to it, read in one transaction."""
        check.text(key, "idempotency key")
        with self._driver.transaction() as cur:
            row = cur.execute(select(operations).where(operations.c.key == key)).first()
            if row is None:
                raise UnknownOperation(key)
            found = cur.execute(
                self._attempt_query()
                .where(attempts.c.operation_id == row.id)
                .order_by(attempts.c.id)
            ).all()
            entries = cur.execute(_journal_of(attempts.c.operation_id == row.id)).all()
            events = cur.execute(
                select(operation_events)
                .where(operation_events.c.operation_id == row.id)
                .order_by(operation_events.c.id)
            ).all()
        return OperationHistory(
            operation_of(row),
            [_attempt(r) for r in found],
            [_entry(e) for e in entries],
            [
                OperationEvent(e.kind, e.from_status, e.to_status, e.by, e.note, e.created_at)
                for e in events
            ],
        )

    def attempt_journal(self, key: str) -> list[JournalEntry]:
        """Attempt ``key``'s journal entries (one per budget in its chain for each
        hold, charge, release or correction), oldest first."""
        check.text(key, "key")
        with self._driver.transaction() as cur:
            rows = cur.execute(_journal_of(attempts.c.key == key)).all()
        return [_entry(e) for e in rows]

    def operation_attempts(self, keys: list[str]) -> dict[str, list[Attempt]]:
        """The attempts of operations ``keys`` (read by the attempts' operation index),
        oldest first, by operation key; an operation without attempts is left out."""
        for key in keys:
            check.text(key, "idempotency key")
        if not keys:
            return {}
        ids = select(operations.c.id).where(operations.c.key.in_(list(keys)))
        query = (
            self._attempt_query().where(attempts.c.operation_id.in_(ids)).order_by(attempts.c.id)
        )
        out: dict[str, list[Attempt]] = {}
        with self._driver.transaction() as cur:
            for row in cur.execute(query):
                found = _attempt(row)
                out.setdefault(str(found.operation_key), []).append(found)
        return out

    def reopen_operation(self, key: str, *, reason: str, by: str | None = None) -> Operation:
        """Reopen failed operation ``key``: it becomes retryable, its dead runs are no
        longer counted, and its next delivery runs it again (labelled calls whose
        results were stored replay; the rest are sent again, as new attempts). Refused
        (:class:`CannotReopen`) unless it failed and none of its calls holds money
        (reserved, in flight or unknown). Recorded as an event, and a journal row (kind
        ``reopen``), naming ``by`` (default: the OS user and host) and ``reason``, in
        the same transaction."""
        check.text(key, "idempotency key")
        check.text(reason, "reason", max_length=10_000)
        by = check.actor(by)
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            row = self._lock_operation(cur, key=key)
            if row.status != OperationStatus.FAILED:
                raise CannotReopen(key, f"it is {row.status}; only a failed operation reopens")
            held = [a.key for a in self._attempts_of(cur, row.id) if a.state in HOLDING]
            if held:
                raise CannotReopen(key, f"its call {held[0]} still holds money; resolve it first")
            to = OperationStatus.RETRYABLE
            params = {"operation_id": row.id, "now": stamp}
            cur.run(sql.REOPEN_OPERATION, {**params, "status": to, "expected": row.status})
            cur.run(
                sql.INSERT_OPERATION_EVENT,
                {
                    **params,
                    "kind": "reopen",
                    "from_status": row.status,
                    "to_status": to,
                    "by": by,
                    "note": reason,
                },
            )
            period = cur.one(sql.LATEST_PERIOD_OF_OPERATION, {"operation_id": row.id})
            if period is not None:
                _journal(cur, None, period[0], "reopen", 0, 0, reason, stamp, key, by)
        return self.operation_history(key).operation


def _entry(e: Any) -> JournalEntry:
    return JournalEntry(
        e.attempt, e.budget, e.kind, e.held_delta, e.spent_delta, e.note, e.created_at, e.actor
    )


def _journal_of(which: Any) -> Any:
    """The journal entries of the attempts ``which`` selects, oldest first, each with
    its attempt's key and its budget (a slice's rows are its owner's)."""
    owner = budgets.alias("owner")
    return (
        select(
            journal,
            attempts.c.key.label("attempt"),
            func.coalesce(owner.c.name, budgets.c.name).label("budget"),
        )
        .join(attempts, attempts.c.id == journal.c.attempt_id)
        .join(budget_periods, budget_periods.c.id == journal.c.period_id)
        .join(budgets, budgets.c.id == budget_periods.c.budget_id)
        .outerjoin(owner, owner.c.id == budgets.c.slice_of)
        .where(which)
        .order_by(journal.c.id)
    )
