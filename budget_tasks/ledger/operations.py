"""Operations: one business intent per idempotency key, with a lease while a worker runs
it and its stored outcome, so that a redelivery replays instead of resending.

Every write here is compare-and-set: the operation row is locked, its status and lease
owner as read are named in the UPDATE, and what an operation becomes when no run
decides it is derived from its attempts, never from what a writer read earlier:

- an attempt still open (sending, unknown) makes it ``unknown``;
- its latest main-call attempt settled with an answer a reconciliation found makes it
  ``succeeded`` with that answer;
- otherwise the writer's fallback (``pending``, ``retryable``, ``failed``) applies.

A run that ends gives its lease back through :meth:`.CallLedger.end_run` or
:meth:`.CallLedger.finish_operation`; beat and operators conclude through
:meth:`.Upkeep.conclude_operation`, which never touches an operation a live run
leases (the run adopts the outcome when it ends). This module holds those rules as
functions over the store; the callers' classes own the methods.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from .. import _validate as check
from .._redact import redact
from ..errors import (
    BudgetExceeded,
    BudgetFrozen,
    IdempotencyConflict,
    InvalidTransition,
    SettlementConflict,
    UnknownAttempt,
    UnknownBudget,
    UnknownOperation,
)
from . import functions
from . import statements as sql
from .driver import Cursor
from .holds import CallPlan, attempt_params, call_row
from .leases import lease_is_live
from .records import AttemptRef, CallAdmission, CallAsk, CallEnd, SettledCall
from .states import FINISHED, OPEN, AttemptState, OperationStatus, operation_may
from .store import Chain, Resolution, Store, made_now

log = logging.getLogger("budget_tasks.ledger")


class Decision(enum.Enum):
    RUN = "run"  # the lease is ours: go on
    REPLAY = "replay"  # succeeded before: return the stored result
    FAILED = "failed"  # failed for good before: report the stored error
    IN_PROGRESS = "in_progress"  # another worker holds a live lease: retry later
    POISONED = "poisoned"  # too many runs died: stop this message


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
    #: where the lease was taken (``run``): the main call's admission, call 0 of the
    #: operation (its latest attempt, and the one the admission made, if it did)
    call: CallAdmission | None = None
    #: the first labelled call's admission, where it was asked with the run's (see
    #: :meth:`~budget_tasks.ledger.CallLedger.admit`)
    first: CallAdmission | None = None
    #: the operation was created by this delivery: nothing earlier is at any position
    created: bool = False


@dataclass(frozen=True, slots=True)
class RunEnd:
    """Where an operation stands after a write that ends a run (or concludes it).

    ``applied`` says whether this write moved it; when it did not, ``status`` is what
    the writer found (another run, beat or an operator got there first)."""

    status: str
    result: Any = None
    error: str | None = None
    applied: bool = True


@dataclass(frozen=True, slots=True)
class _Row:
    id: int
    fingerprint: str
    status: str
    result: str | None
    error: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    runs: int
    next_reason: str | None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def run_by(self, owner: str) -> bool:
        """Whether ``owner``'s run holds the operation now."""
        return self.lease_owner == owner and self.status == OperationStatus.RUNNING


def operation_ref(operation: int | str) -> dict[str, Any]:
    """How to find an operation: by id (admitted) or by key."""
    if isinstance(operation, str):
        return {"key": check.text(operation, "idempotency key")}
    return {"op_id": check.row_id(operation, "operation_id")}


def decode(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _payload(payload: Any) -> str | None:
    return None if payload is None else json.dumps(payload, default=repr)


def _delivery_params(ask: Ask, now: datetime, ts: Any) -> dict[str, Any]:
    """The delivery's part of :data:`.functions.ADMIT`."""
    return {
        "key": ask.key,
        "fingerprint": ask.fingerprint,
        "task": ask.task,
        "payload": _payload(ask.payload),
        "owner": ask.owner,
        "expires": ts(now + ask.lease),
    }


@dataclass(frozen=True, slots=True)
class Ask:
    """A delivery as it asks to be admitted."""

    key: str
    fingerprint: str
    owner: str
    lease: timedelta
    max_runs: int
    task: str | None
    payload: Any


def check_delivery(ask: Ask) -> None:
    check.key(ask.key, "idempotency key")
    check.text(ask.fingerprint, "fingerprint")
    check.text(ask.owner, "lease owner")
    check.duration(ask.lease, "lease")
    check.positive(ask.max_runs, "max_runs")
    check.optional_text(ask.task, "task name")


class Refused(Exception):
    """Internal: admission was refused; raised out of its transaction to roll it back."""

    def __init__(self, exc: BudgetExceeded | BudgetFrozen) -> None:
        super().__init__(str(exc))
        self.exc = exc


def lock_operation(store: Store, cur: Cursor, *, key: str | None = None, op_id: int = 0) -> _Row:
    if key is not None:
        row = cur.one(sql.LOCK_OPERATION, {"key": key})
    else:
        row = cur.one(sql.LOCK_OPERATION_BY_ID, {"operation_id": op_id})
    if row is None:
        raise UnknownOperation(key if key is not None else f"id {op_id}")
    op_id_, fp, status, result, error, owner, expires, runs, nxt = row
    return _Row(
        op_id_,
        fp,
        status,
        result,
        error,
        owner,
        None if expires is None else store.driver.from_ts(expires),
        runs,
        nxt,
    )


def attempts_of(cur: Cursor, op_id: int) -> list[AttemptRef]:
    return [AttemptRef(*r[1:]) for r in cur.all(sql.OPERATION_ATTEMPTS, {"operation_id": op_id})]


def conclusion(attempts: Sequence[AttemptRef]) -> tuple[str, str | None] | None:
    """What the attempts alone say the operation is, or None if they leave it to
    the writer. Only the latest attempt of each call counts (an earlier one that a
    resend replaced is reconciled on its own): one open makes it unknown; else an
    answer found for its main call makes it succeeded."""
    main = next((a for a in attempts if a.label is None), None)
    latest = [a for a in attempts if a.label is not None]
    if main is not None:
        latest.append(main)
    if any(a.state in OPEN for a in latest):
        return OperationStatus.UNKNOWN, None
    if main is not None and main.state == AttemptState.SETTLED and main.answer is not None:
        return OperationStatus.SUCCEEDED, main.answer
    return None


def set_status(
    cur: Cursor,
    row: _Row,
    status: str,
    stamp: Any,
    *,
    result: str | None = None,
    error: str | None = None,
    next_reason: str | None = None,
    run_ended: bool,
) -> bool:
    """Compare-and-set the operation from the status and owner ``row`` was read
    with; True if it applied."""
    if not operation_may(row.status, status):
        raise InvalidTransition(f"operation {row.id}", row.status, f"move it to {status}")
    return bool(
        cur.run(
            sql.SET_OPERATION,
            {
                "status": str(status),
                "result": result,
                "error": None if error is None else redact(error),
                "next_reason": next_reason,
                "now": stamp,
                "completed_at": stamp if status in FINISHED else None,
                "run_ended": 1 if run_ended else 0,
                "operation_id": row.id,
                "expected": row.status,
                "expected_owner": row.lease_owner,
            },
        )
    )


def end_call_in(
    store: Store, cur: Cursor, call: CallEnd, stamp: Any, *, lease_mine: bool
) -> tuple[Resolution | None, bool] | None:
    """Write what ``call`` came to, in the caller's transaction (its attempt, then
    its operation, locked first: the order every writer locks them in). The one
    path for every call's outcome, the main call's and each labelled call's.

    A settlement always lands (what the provider billed: an attempt resolved
    meanwhile keeps the larger charge). A release or an unknown lands only under
    the run's own lease (``lease_mine``): once another run has taken the operation,
    that run or reconciliation decides the hold, and None is returned. Otherwise
    the resolution (whose counters the caller applies last) and whether a state
    changed without one (an unknown)."""
    if call.action in ("release", "unknown", "unsent") and not lease_mine:
        log.warning("attempt %s: %s dropped: its run's lease moved on", call.key, call.action)
        return None
    if call.action == "settle":
        # as a run that got its answer settles: a resolution meanwhile keeps the
        # larger charge
        resolution = store.resolve_in(
            cur,
            call.key,
            call.actual,
            "settled",
            "charge",
            None,
            stamp,
            estimate_only=call.estimate_only,
            if_resolved="top_up",
            answered=call.answered,
        )
        return resolution, False
    if call.action == "release":
        # The error text stays on the attempt (purged with it); the append-only
        # journal, kept for ever, says only what happened.
        note = call.note or "not billed"
        journal = "released by its run: not billed"
        return (
            store.release_in(
                cur, call.key, note, stamp, journal_note=journal, seen=call.answered.seen
            ),
            False,
        )
    if call.action == "unsent":
        note = call.note or "never sent: the ledger went down as it was granted"
        try:
            return store.release_in(cur, call.key, note, stamp, expected="sending"), False
        except (InvalidTransition, SettlementConflict):
            return None  # never granted, or moved on since: nothing of this run's
    if call.action == "unknown":
        note = call.note or "outcome unknown"
        return None, store.mark_unknown_in(
            cur, call.key, note, call.actual or None, call.answered, untrusted=call.untrusted
        )
    return None, False  # store: the hold was resolved already


def settle_calls_in(
    store: Store, cur: Cursor, operation_id: int, settled: Sequence[SettledCall], stamp: Any
) -> list[tuple[Resolution | None, bool] | None]:
    """Settle each call of ``settled`` and store its answer for replay, in the caller's
    transaction; the resolutions, whose counters the caller applies last."""
    ended = []
    for one in settled:
        ended.append(end_call_in(store, cur, one.call, stamp, lease_mine=True))
        encoded = store.kept_text(json.dumps(one.result))
        store_answer_in(cur, operation_id, one.record, encoded, stamp)
    return ended


def store_answer_in(cur: Cursor, operation_id: int, record: str, encoded: str, stamp: Any) -> None:
    """Store a call's answer (``encoded``) under ``record``, for replay."""
    cur.run(
        sql.STORE_SIDE_EFFECT,
        {"operation_id": operation_id, "name": record, "result": encoded, "now": stamp},
    )


def release_reserved(
    store: Store, cur: Cursor, attempts: Iterable[AttemptRef], stamp: Any
) -> list[Any]:
    """Release the holds of attempts never granted a send (state reserved): no run
    will send them now. Returns the resolutions, whose counters the caller applies."""
    return [
        store.release_in(cur, a.key, "never sent: its run ended", stamp)
        for a in attempts
        if a.state == AttemptState.RESERVED
    ]


def admitted_alone(
    store: Store, ask: Ask, call: CallAsk | None, chain: Chain | None, plan: CallPlan | None
) -> OperationStart | None:
    """The common case of :meth:`admit` (a finished key's replay; a first delivery,
    its main call reserved and granted) as one function call (see
    :mod:`.functions`); None where it declined: the statement path decides."""
    now = store.now()
    # the chain's periods, opened if new, as the statement path's admission opens them
    found = None if chain is None else store.find_holds(chain, now)
    stamp = store.driver.ts(now)
    delivery = {**_delivery_params(ask, now, store.driver.ts), "now": stamp}
    attempt: dict[str, Any] = {}
    made = None
    if call is not None and chain is not None and found is not None and plan is not None:
        # A first delivery finds nothing at its main call's position: its plan then.
        planned = plan(CallAdmission(0))
        if planned is not None:
            row = call_row(chain, call, planned, None)
            attempt = attempt_params(chain, found, row, call.facts, stamp)
            start = found.periods[chain[0][0]][1]
            made = made_now(store.owner_of(chain), start, row, call.facts)
    answer = store.sent_alone(functions.ADMIT, functions.admit_params(delivery, attempt))
    if answer is None:
        return None
    decision, op_id, stored, runs = answer
    if decision == "replay":
        result = decode(stored)
        return OperationStart(Decision.REPLAY, op_id, ask.key, result=result, runs=runs)
    return OperationStart(
        Decision.RUN,
        op_id,
        ask.key,
        runs=runs,
        lease_expires_at=now + ask.lease,
        call=CallAdmission(op_id, reservation=made),
    )


def chain_or_none(store: Store, budget: str) -> Chain | None:
    """The budget chain a delivery's main call is admitted on; None for a budget
    that does not exist (the delivery is decided alone)."""
    try:
        return store.admission_chain(budget)
    except UnknownBudget:
        return None


def begin_or_replay_in(store: Store, cur: Cursor, ask: Ask, now: datetime) -> OperationStart:
    """A finished key replays in one statement; any other delivery is recorded and
    decided."""
    stamp = store.driver.ts(now)
    params = {"key": ask.key, "fingerprint": ask.fingerprint, "now": stamp}
    replayed = cur.one(sql.REPLAY, params)
    if replayed is None:
        return begin_in(store, cur, ask, now)
    op_id, result, runs = replayed
    return OperationStart(Decision.REPLAY, op_id, ask.key, result=decode(result), runs=runs)


def record_refusal(
    store: Store,
    key: str,
    fingerprint: str,
    task: str | None,
    payload: Any,
    error: str,
) -> None:
    with store.driver.transaction() as cur:
        cur.run(
            sql.RECORD_REFUSAL,
            {
                "key": key,
                "fingerprint": fingerprint,
                "task": task,
                "payload": _payload(payload),
                "error": redact(error),
                "now": store.driver.ts(store.now()),
            },
        )


def begin_in(store: Store, cur: Cursor, ask: Ask, now: datetime) -> OperationStart:
    """Record the delivery ``ask`` and decide it (see :class:`Decision`)."""
    stamp = store.driver.ts(now)
    expires = now + ask.lease
    created = cur.one(
        sql.INSERT_RUNNING_OPERATION,
        {
            "key": ask.key,
            "fingerprint": ask.fingerprint,
            "task": ask.task,
            "payload": _payload(ask.payload),
            "owner": ask.owner,
            "expires": store.driver.ts(expires),
            "now": stamp,
        },
    )
    if created is not None:  # the first delivery: the lease is ours, nothing to read
        return OperationStart(
            Decision.RUN,
            created[0],
            ask.key,
            runs=1,
            lease_expires_at=expires,
            call=CallAdmission(created[0]),
            created=True,
        )
    row = lock_operation(store, cur, key=ask.key)
    if row.fingerprint != ask.fingerprint:
        raise IdempotencyConflict(ask.key, "fingerprint", row.fingerprint, ask.fingerprint)
    told = finished_or_busy(row, ask, now)
    attempts = [] if told is not None else attempts_of(cur, row.id)
    if told is None:
        told = adopted_or_poisoned_in(store, cur, row, ask, now, attempts)
    if told is not None:
        replay = 1 if told.decision is Decision.REPLAY else 0
        cur.run(sql.COUNT_DELIVERY, {"replay": replay, "now": stamp, "operation_id": row.id})
        return told
    return take_run_in(store, cur, row, ask, now, attempts)


def finished_or_busy(row: _Row, ask: Ask, now: datetime) -> OperationStart | None:
    """A finished operation replays or fails; another run's live lease says wait."""
    if row.status == OperationStatus.SUCCEEDED:
        # A result purged after its retention replays as None.
        return OperationStart(
            Decision.REPLAY, row.id, ask.key, runs=row.runs, result=decode(row.result)
        )
    if row.status == OperationStatus.FAILED:
        return OperationStart(Decision.FAILED, row.id, ask.key, runs=row.runs, error=row.error)
    mine = row.run_by(ask.owner)
    if not mine and lease_is_live(row.lease_owner, row.lease_expires_at, now):
        return OperationStart(
            Decision.IN_PROGRESS,
            row.id,
            ask.key,
            runs=row.runs,
            lease_expires_at=row.lease_expires_at,
        )
    return None


def adopted_or_poisoned_in(
    store: Store, cur: Cursor, row: _Row, ask: Ask, now: datetime, attempts: list[AttemptRef]
) -> OperationStart | None:
    """An answer reconciliation found is adopted; too many dead runs stop the
    message. None: the delivery runs."""
    stamp = store.driver.ts(now)
    mine = row.run_by(ask.owner)
    concluded = conclusion(attempts)
    if concluded is not None and concluded[0] == OperationStatus.SUCCEEDED:
        # A reconciliation found the answer while no run could take it: adopt it.
        set_status(cur, row, concluded[0], stamp, result=concluded[1], run_ended=mine)
        return OperationStart(
            Decision.REPLAY, row.id, ask.key, runs=row.runs, result=decode(concluded[1])
        )
    if not mine and row.runs >= ask.max_runs:
        error = f"poison message: {row.runs} runs of {ask.key!r} never finished"
        resolutions = release_reserved(store, cur, attempts, stamp)
        set_status(cur, row, OperationStatus.FAILED, stamp, error=error, run_ended=False)
        for resolution in resolutions:
            resolution.apply(cur)
        return OperationStart(Decision.POISONED, row.id, ask.key, runs=row.runs, error=error)
    return None


def take_run_in(
    store: Store, cur: Cursor, row: _Row, ask: Ask, now: datetime, attempts: list[AttemptRef]
) -> OperationStart:
    """The lease for this delivery's run: renewed for its own owner, else taken (one
    more run)."""
    mine = row.run_by(ask.owner)
    expires = now + ask.lease
    params = {
        "expires": store.driver.ts(expires),
        "now": store.driver.ts(now),
        "operation_id": row.id,
    }
    if mine:
        cur.run(sql.RENEW_LEASE, params)
    else:
        cur.run(sql.TAKE_LEASE, {**params, "owner": ask.owner})
    main = [a for a in attempts if a.label is None]
    call = CallAdmission(
        row.id,
        main[0] if main else None,
        len(main),
        next_reason=row.next_reason,
        others_open=tuple(a for a in attempts if a.label is not None and a.state in OPEN),
    )
    return OperationStart(
        Decision.RUN,
        row.id,
        ask.key,
        runs=row.runs if mine else row.runs + 1,
        lease_expires_at=expires,
        call=call,
    )


def end_in(
    store: Store,
    cur: Cursor,
    row: _Row,
    now: datetime,
    stamp: Any,
    *,
    owner: str | None,
    status: str | None,
    error: str | None,
    next_reason: str | None,
    fallback: str,
) -> RunEnd:
    if row.finished:
        return RunEnd(row.status, decode(row.result), row.error, applied=False)
    mine = owner is not None and row.lease_owner == owner
    mine = mine and row.status == OperationStatus.RUNNING
    if not mine and lease_is_live(row.lease_owner, row.lease_expires_at, now):
        return RunEnd(row.status, None, row.error, applied=False)
    attempts = attempts_of(cur, row.id)
    resolutions = release_reserved(store, cur, attempts, stamp)
    concluded = conclusion(attempts)
    result = None
    target: str
    if status == OperationStatus.FAILED and mine:
        target = OperationStatus.FAILED
    elif concluded is not None:
        target, result = concluded
        error = error if target != OperationStatus.SUCCEEDED else None
    else:
        target = status if (status is not None and mine) else fallback
    if target == OperationStatus.RETRYABLE:
        next_reason = next_reason or "redelivery"
    elif target != OperationStatus.PENDING:
        next_reason = None
    applied = set_status(
        cur,
        row,
        target,
        stamp,
        result=result,
        error=error,
        next_reason=next_reason,
        run_ended=mine,
    )
    for resolution in resolutions:
        resolution.apply(cur)
    return RunEnd(target, decode(result), error, applied=applied)


def conclude_in(
    store: Store,
    cur: Cursor,
    row: _Row,
    now: datetime,
    stamp: Any,
    fallback: str,
    error: str | None,
    next_reason: str | None,
) -> RunEnd:
    if fallback == OperationStatus.FAILED:
        # Failing for good is a run's or an operator's decision, never a fallback
        # over an open attempt or a found answer: derive first.
        attempts = attempts_of(cur, row.id)
        concluded = conclusion(attempts)
        if concluded is None and not row.finished:
            if lease_is_live(row.lease_owner, row.lease_expires_at, now):
                return RunEnd(row.status, None, row.error, applied=False)
            resolutions = release_reserved(store, cur, attempts, stamp)
            applied = set_status(
                cur, row, OperationStatus.FAILED, stamp, error=error, run_ended=False
            )
            for resolution in resolutions:
                resolution.apply(cur)
            return RunEnd(OperationStatus.FAILED, None, error, applied=applied)
        fallback = OperationStatus.RETRYABLE
    end: RunEnd = end_in(
        store,
        cur,
        row,
        now,
        stamp,
        owner=None,
        status=None,
        error=error,
        next_reason=next_reason,
        fallback=fallback,
    )
    return end


def finished_alone(
    store: Store,
    operation_id: int,
    call: CallEnd | None,
    owner: str | None,
    encoded: str,
    stamp: Any,
    settled: Sequence[SettledCall] = (),
) -> bool:
    """:meth:`finish_operation`'s common case (the run's one call settled: its main
    call, or its one labelled call with no main attempt) as one function call (see
    :mod:`.functions`); False where it is not that case or the function declined: the
    statement path decides."""
    if not store.use_functions or owner is None:
        return False
    record = answer = None
    if settled:
        if call is not None or len(settled) != 1:
            return False
        call, record = settled[0].call, settled[0].record
        answer = store.kept_text(json.dumps(settled[0].result))
    if call is None or call.action != "settle":
        return False
    return store.settled_alone(
        call.key,
        call.actual,
        stamp,
        estimate_only=call.estimate_only,
        answered=call.answered,
        operation_id=operation_id,
        owner=owner,
        result=encoded,
        record=record,
        answer=answer,
    )


def call_and_operation_in(
    store: Store,
    cur: Cursor,
    call: CallEnd | None,
    owner: str | None,
    stamp: Any,
    *,
    key: str | None = None,
    op_id: int = 0,
) -> tuple[_Row, tuple[Resolution | None, bool] | None]:
    """Write what ``call`` came to under ``owner``'s lease and lock its operation
    (by ``key`` or ``op_id``), the attempt locked first: the order every writer
    locks them in."""
    if call is None:
        return lock_operation(store, cur, key=key, op_id=op_id), None
    if call.action == "settle":
        # a settlement lands whoever holds the lease, and locks its attempt itself
        ended = end_call_in(store, cur, call, stamp, lease_mine=True)
        return lock_operation(store, cur, key=key, op_id=op_id), ended
    if not cur.all(sql.LOCK_ATTEMPT, {"key": call.key}):
        if call.action == "unsent":  # the admission never committed
            return lock_operation(store, cur, key=key, op_id=op_id), None
        raise UnknownAttempt(call.key)
    row = lock_operation(store, cur, key=key, op_id=op_id)
    mine = owner is None or row.lease_owner == owner
    return row, end_call_in(store, cur, call, stamp, lease_mine=mine)


def apply_call(cur: Cursor, ended: tuple[Resolution | None, bool] | None) -> bool:
    """Apply a call's resolution to the counters (last: the budget rows are the
    contended ones); whether anything changed."""
    if ended is None:
        return False
    resolution, changed = ended
    if resolution is None:
        return changed
    resolution.apply(cur)
    return resolution.applied


def log_call(store: Store, ended: tuple[Resolution | None, bool] | None) -> None:
    """Once its transaction committed: a call charged above its hold is an overrun."""
    resolution = None if ended is None else ended[0]
    if resolution is not None and resolution.applied and resolution.actual > resolution.amount:
        store.log_overrun(resolution.key, resolution.amount, resolution.actual)


def store_result_in(
    store: Store,
    cur: Cursor,
    row: _Row,
    now: datetime,
    stamp: Any,
    owner: str | None,
    attempt: str | None,
    encoded: str,
) -> RunEnd:
    if row.finished:
        return RunEnd(row.status, decode(row.result), row.error, applied=False)
    mine = owner is None or row.run_by(owner)
    attempts = attempts_of(cur, row.id)
    if not mine:
        if lease_is_live(row.lease_owner, row.lease_expires_at, now):
            return RunEnd(row.status, None, row.error, applied=False)
        latest = next((a for a in attempts if a.label is None), None)
        if attempt is not None and (latest is None or latest.key != attempt):
            return RunEnd(row.status, None, row.error, applied=False)
    resolutions = release_reserved(store, cur, attempts, stamp)
    applied = set_status(
        cur,
        row,
        OperationStatus.SUCCEEDED,
        stamp,
        result=encoded,
        run_ended=mine and owner is not None,
    )
    for resolution in resolutions:
        resolution.apply(cur)
    return RunEnd(OperationStatus.SUCCEEDED, json.loads(encoded), None, applied=applied)
