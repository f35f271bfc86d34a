"""An outcome resolved from outside its run (reconciliation, an operator): the attempt
settled or released, then its operation concluded, in one transaction. Shared by
:class:`.Upkeep` and the operator's :class:`.Ledger`."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from .. import _validate as check
from ..errors import InvalidTransition, UnknownAttempt
from . import statements as sql
from .driver import Cursor
from .operations import RunEnd, conclude_in, lock_operation
from .records import NOTHING_ANSWERED, Answered, Resolved
from .store import Store

STALE_STATES = ("sending", "unknown")


def _check_resolution(key: str, actual: int, note: str, by: str) -> None:
    check.text(key, "key")
    check.money(actual, "actual")
    check.text(note, "note", max_length=10_000)
    if by not in ("reconcile", "operator"):
        raise ValueError(f"by must be reconcile or operator, not {by!r}")


def resolve_attempt(
    store: Store,
    key: str,
    actual: int,
    *,
    note: str,
    by: str,
    answer: Any = None,
    expected: str | None = None,
    actor: str | None = None,
    answered: Answered = NOTHING_ANSWERED,
) -> Resolved:
    """Resolve an attempt from outside its run: settle it at ``actual`` (release it
    at 0), then conclude its operation, in one transaction.

    ``by`` is ``reconcile`` or ``operator``; an operator's resolution names
    ``actor`` in the journal (default: the OS user and host). ``answer``
    (reconciliation: what the provider answered) is kept on the attempt for its
    operation to adopt, and ``answered`` what it said it used.
    ``expected`` is the state the caller read: the resolution applies only from it
    (compare-and-set). The operation is touched only while this attempt is still
    the latest of its call, the operation is unfinished and no live run leases it;
    when its attempts leave it open it becomes retryable, or, for an operator's
    charge without an answer, failed (the answer is lost)."""
    _check_resolution(key, actual, note, by)
    actor = check.actor(actor) if by == "operator" else None
    encoded = None if answer is None else store.kept_text(json.dumps(answer))
    now = store.now()
    stamp = store.driver.ts(now)
    state = "released" if actual == 0 and answer is None else "settled"
    kind = "release" if state == "released" else "charge"
    recorded = f"{by}: {note}"
    with store.driver.transaction() as cur:
        position = cur.one(sql.ATTEMPT_POSITION, {"key": key})
        if position is None:
            raise UnknownAttempt(key)
        operation_id, op_key, _label, before, latest = position
        if before == "reserved" and state == "settled":
            raise InvalidTransition(key, before, "charge an attempt that was never sent")
        resolution = store.resolve_in(
            cur,
            key,
            actual,
            state,
            kind,
            recorded,
            stamp,
            expected=expected,
            answer=encoded,
            actor=actor,
            answered=answered,
        )
        end = None
        if operation_id is not None and latest:
            lost = state == "settled" and answer is None
            end = conclude_resolved_in(store, cur, operation_id, key, actual, recorded, lost, now)
        resolution.apply(cur)
    if resolution.applied and actual > resolution.amount:
        store.log_overrun(key, resolution.amount, actual)
    return Resolved(
        key=key,
        applied=resolution.applied,
        state=state if resolution.applied else before,
        actual=resolution.actual,
        amount=resolution.amount,
        operation=op_key,
        operation_status=None if end is None else end.status,
        operation_changed=end is not None and end.applied,
    )


def conclude_resolved_in(
    store: Store,
    cur: Cursor,
    operation_id: int,
    key: str,
    actual: int,
    recorded: str,
    lost: bool,
    now: datetime,
) -> RunEnd:
    """Conclude the operation of an attempt resolved from outside its run: retryable
    where its attempts leave it open, failed where the charge's answer is lost."""
    error = recorded
    if lost:
        error = (
            f"attempt {key} was charged {actual} and its answer is lost ({recorded}): "
            "the work is not sent again; enqueue it under a new key if it must be done"
        )
    row = lock_operation(store, cur, op_id=operation_id)
    fallback = "failed" if lost else "retryable"
    end: RunEnd = conclude_in(store, cur, row, now, store.driver.ts(now), fallback, error, None)
    return end
