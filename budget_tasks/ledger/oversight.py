"""What is read of operations: the list by status and one operation's whole history
(its attempts, their journal, what operators did), shared by the operator's ledger and
the dashboard's views."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from .. import _validate as check
from ..errors import UnknownOperation
from . import reports
from .records import Attempt, JournalEntry, Operation, OperationEvent
from .schema import (
    attempts,
    budget_periods,
    budgets,
    journal,
    operation_events,
    operations,
)
from .states import OPERATION_STATUSES
from .store import Store, attempt_of

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


def recent_operations(
    store: Store, *, status: str | None = None, limit: int = 100
) -> list[Operation]:
    """Operations, the most recently changed first, optionally in one status."""
    if status is not None and status not in OPERATION_STATUSES:
        raise ValueError(f"status must be one of {OPERATION_STATUSES}, not {status!r}")
    check.positive(limit, "limit")
    query = select(operations).order_by(operations.c.updated_at.desc(), operations.c.id)
    if status is not None:
        query = query.where(operations.c.status == status)
    with store.driver.transaction() as cur:
        rows = cur.execute(query.limit(min(limit, MAX_LISTED))).all()
    return [operation_of(r) for r in rows]


def operation_history(store: Store, key: str) -> OperationHistory:
    """Operation ``key``, its attempts (oldest first), their journal entries and what
    operators did to it, read in one transaction."""
    check.text(key, "idempotency key")
    with store.driver.transaction() as cur:
        row = cur.execute(select(operations).where(operations.c.key == key)).first()
        if row is None:
            raise UnknownOperation(key)
        found = cur.execute(
            reports.attempt_query().where(attempts.c.operation_id == row.id).order_by(attempts.c.id)
        ).all()
        entries = cur.execute(journal_of(attempts.c.operation_id == row.id)).all()
        events = cur.execute(
            select(operation_events)
            .where(operation_events.c.operation_id == row.id)
            .order_by(operation_events.c.id)
        ).all()
    return OperationHistory(
        operation_of(row),
        [attempt_of(r) for r in found],
        [entry_of(e) for e in entries],
        [
            OperationEvent(e.kind, e.from_status, e.to_status, e.by, e.note, e.created_at)
            for e in events
        ],
    )


def entry_of(e: Any) -> JournalEntry:
    return JournalEntry(
        e.attempt, e.budget, e.kind, e.held_delta, e.spent_delta, e.note, e.created_at, e.actor
    )


def journal_of(which: Any) -> Any:
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
