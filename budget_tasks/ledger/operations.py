"""Operations: one business intent per idempotency key, with a lease while a worker runs
it and its stored outcome, so that a redelivery replays instead of resending.

Every write here is compare-and-set: the operation row is locked, its status and lease
owner as read are named in the UPDATE, and what an operation becomes when no run
decides it is derived from its attempts, never from what a writer read earlier:

- an attempt still open (sending, unknown) makes it ``unknown``;
- its latest main-call attempt settled with an answer a reconciliation found makes it
  ``succeeded`` with that answer;
- otherwise the writer's fallback (``pending``, ``retryable``, ``failed``) applies.

A run that ends gives its lease back through :meth:`Operations.end_run` or
:meth:`Operations.finish_operation`; beat and operators conclude through
:meth:`Operations.conclude_operation`, which never touches an operation a live
run leases (the run adopts the outcome when it ends).
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
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
from .base import Chain, Found, _Resolution, made_now
from .driver import Cursor
from .holds import CallPlan, Holds, attempt_params, call_row
from .leases import lease_is_live, owner_id
from .records import AttemptRef, CallAdmission, CallAsk, CallEnd
from .states import FINISHED, OPEN, AttemptState, OperationStatus, operation_may

log = logging.getLogger("budget_tasks.ledger")

__all__ = [
    "AttemptRef",
    "Decision",
    "OperationStart",
    "Operations",
    "RunEnd",
    "lease_is_live",
    "owner_id",
]


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


def _operation_ref(operation: int | str) -> dict[str, Any]:
    """How to find an operation: by id (admitted) or by key."""
    if isinstance(operation, str):
        return {"key": check.text(operation, "idempotency key")}
    return {"op_id": check.row_id(operation, "operation_id")}


def _decode(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _payload(payload: Any) -> str | None:
    return None if payload is None else json.dumps(payload, default=repr)


def _delivery_params(ask: _Ask, now: datetime, ts: Any) -> dict[str, Any]:
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
class _Ask:
    """A delivery as it asks to be admitted."""

    key: str
    fingerprint: str
    owner: str
    lease: timedelta
    max_runs: int
    task: str | None
    payload: Any


def _check_delivery(ask: _Ask) -> None:
    check.key(ask.key, "idempotency key")
    check.text(ask.fingerprint, "fingerprint")
    check.text(ask.owner, "lease owner")
    check.duration(ask.lease, "lease")
    check.positive(ask.max_runs, "max_runs")
    check.optional_text(ask.task, "task name")


class _Refused(Exception):
    """Internal: admission was refused; raised out of its transaction to roll it back."""

    def __init__(self, exc: BudgetExceeded | BudgetFrozen) -> None:
        super().__init__(str(exc))
        self.exc = exc


class Operations(Holds):
    """The operation methods of :class:`~budget_tasks.Ledger`."""

    # -- reading ---------------------------------------------------------------------

    def _lock_operation(self, cur: Cursor, *, key: str | None = None, op_id: int = 0) -> _Row:
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
            None if expires is None else self._driver.from_ts(expires),
            runs,
            nxt,
        )

    @staticmethod
    def _attempts_of(cur: Cursor, op_id: int) -> list[AttemptRef]:
        return [
            AttemptRef(*r[1:]) for r in cur.all(sql.OPERATION_ATTEMPTS, {"operation_id": op_id})
        ]

    @staticmethod
    def _conclusion(attempts: Sequence[AttemptRef]) -> tuple[str, str | None] | None:
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

    # -- writing ---------------------------------------------------------------------

    def _set(
        self,
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

    def _end_call_in(
        self, cur: Cursor, call: CallEnd, stamp: Any, *, lease_mine: bool
    ) -> tuple[_Resolution | None, bool] | None:
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
            resolution = self._resolve_in(
                cur,
                call.key,
                call.actual,
                "settled",
                "charge",
                None,
                stamp,
                estimate_only=call.estimate_only,
                if_resolved="top_up",
                ids=call.ids,
            )
            return resolution, False
        if call.action == "release":
            # The error text stays on the attempt (purged with it); the append-only
            # journal, kept for ever, says only what happened.
            note = call.note or "not billed"
            journal = "released by its run: not billed"
            return self._release_in(cur, call.key, note, stamp, journal_note=journal), False
        if call.action == "unsent":
            note = call.note or "never sent: the ledger went down as it was granted"
            try:
                return self._release_in(cur, call.key, note, stamp, expected="sending"), False
            except (InvalidTransition, SettlementConflict):
                return None  # never granted, or moved on since: nothing of this run's
        if call.action == "unknown":
            note = call.note or "outcome unknown"
            return None, self._mark_unknown_in(
                cur, call.key, note, call.actual or None, call.ids, untrusted=call.untrusted
            )
        return None, False  # store: the hold was resolved already

    def _release_reserved(
        self, cur: Cursor, attempts: Iterable[AttemptRef], stamp: Any
    ) -> list[Any]:
        """Release the holds of attempts never granted a send (state reserved): no run
        will send them now. Returns the resolutions, whose counters the caller applies."""
        return [
            self._release_in(cur, a.key, "never sent: its run ended", stamp)
            for a in attempts
            if a.state == AttemptState.RESERVED
        ]

    def admit(
        self,
        key: str,
        *,
        fingerprint: str,
        owner: str,
        lease: timedelta,
        max_runs: int,
        task: str | None = None,
        payload: Any = None,
        call: CallAsk | None = None,
        plan: CallPlan | None = None,
    ) -> OperationStart:
        """One delivery's admission in one transaction: a finished key replays (one
        statement); otherwise the delivery is recorded and decided (see
        :class:`Decision`; a live lease's own owner may call again and keeps it without
        counting another run). When it may run, its main ``call`` (call 0) is admitted
        as any call is (see :meth:`~budget_tasks.ledger.steps.Steps.admit_call`): where
        ``plan`` names its attempt, that attempt is reserved on the call's budget chain,
        granted and described in this commit. ``start.call`` says what was found and
        made; a budget that does not exist admits nothing (``plan`` is not asked).

        A refusal (BudgetExceeded, BudgetFrozen) rolls the whole transaction back; the
        operation is then recorded pending with the refusal, in one more statement
        that is the delivery's only commit, and the refusal raised."""
        ask = _Ask(key, fingerprint, owner, lease, max_runs, task, payload)
        _check_delivery(ask)
        chain = None if call is None else self._chain_or_none(call.budget)
        if self._functions:
            alone = self._admitted_alone(ask, call, chain, plan)
            if alone is not None:
                return alone

        def admission(cur: Cursor, found: Found | None, now: datetime) -> OperationStart:
            start = self._begin_or_replay_in(cur, ask, now)
            if start.call is None or call is None or chain is None or found is None:
                return start
            if plan is None:
                return start
            try:
                made = self._admit_call_in(cur, call, start.call, chain, found, now, plan)
            except (BudgetExceeded, BudgetFrozen) as exc:
                raise _Refused(exc) from exc
            return replace(start, call=made)

        try:
            return self._admitting(chain, admission)
        except _Refused as refused:
            self._record_refusal(key, fingerprint, task, payload, str(refused.exc))
            raise refused.exc from None

    def _admitted_alone(
        self, ask: _Ask, call: CallAsk | None, chain: Chain | None, plan: CallPlan | None
    ) -> OperationStart | None:
        """The common case of :meth:`admit` (a finished key's replay; a first delivery,
        its main call reserved and granted) as one function call (see
        :mod:`.functions`); None where it declined: the statement path decides."""
        now = self.now()
        # the chain's periods, opened if new, as the statement path's admission opens them
        found = None if chain is None else self._holds(chain, now)
        stamp = self._driver.ts(now)
        delivery = {**_delivery_params(ask, now, self._driver.ts), "now": stamp}
        attempt: dict[str, Any] = {}
        made = None
        if call is not None and chain is not None and found is not None and plan is not None:
            # A first delivery finds nothing at its main call's position: its plan then.
            planned = plan(CallAdmission(0))
            if planned is not None:
                row = call_row(chain, call, planned, None)
                attempt = attempt_params(chain, found, row, call.facts, stamp)
                start = found.periods[chain[0][0]][1]
                made = made_now(self._owner(chain), start, row, call.facts)
        answer = self._sent_alone(functions.ADMIT, functions.admit_params(delivery, attempt))
        if answer is None:
            return None
        decision, op_id, stored, runs = answer
        if decision == "replay":
            result = _decode(stored)
            return OperationStart(Decision.REPLAY, op_id, ask.key, result=result, runs=runs)
        return OperationStart(
            Decision.RUN,
            op_id,
            ask.key,
            runs=runs,
            lease_expires_at=now + ask.lease,
            call=CallAdmission(op_id, reservation=made),
        )

    def _chain_or_none(self, budget: str) -> Chain | None:
        """The budget chain a delivery's main call is admitted on; None for a budget
        that does not exist (the delivery is decided alone)."""
        try:
            return self._admission_chain(budget)
        except UnknownBudget:
            return None

    def _begin_or_replay_in(self, cur: Cursor, ask: _Ask, now: datetime) -> OperationStart:
        """A finished key replays in one statement; any other delivery is recorded and
        decided."""
        stamp = self._driver.ts(now)
        params = {"key": ask.key, "fingerprint": ask.fingerprint, "now": stamp}
        replayed = cur.one(sql.REPLAY, params)
        if replayed is None:
            return self._begin_in(cur, ask, now)
        op_id, result, runs = replayed
        return OperationStart(Decision.REPLAY, op_id, ask.key, result=_decode(result), runs=runs)

    def _record_refusal(
        self,
        key: str,
        fingerprint: str,
        task: str | None,
        payload: Any,
        error: str,
    ) -> None:
        with self._driver.transaction() as cur:
            cur.run(
                sql.RECORD_REFUSAL,
                {
                    "key": key,
                    "fingerprint": fingerprint,
                    "task": task,
                    "payload": _payload(payload),
                    "error": redact(error),
                    "now": self._driver.ts(self.now()),
                },
            )

    def _begin_in(self, cur: Cursor, ask: _Ask, now: datetime) -> OperationStart:
        """Record the delivery ``ask`` and decide it (see :class:`Decision`)."""
        stamp = self._driver.ts(now)
        expires = now + ask.lease
        created = cur.one(
            sql.INSERT_RUNNING_OPERATION,
            {
                "key": ask.key,
                "fingerprint": ask.fingerprint,
                "task": ask.task,
                "payload": _payload(ask.payload),
                "owner": ask.owner,
                "expires": self._driver.ts(expires),
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
            )
        row = self._lock_operation(cur, key=ask.key)
        if row.fingerprint != ask.fingerprint:
            raise IdempotencyConflict(ask.key, "fingerprint", row.fingerprint, ask.fingerprint)
        told = self._finished_or_busy(row, ask, now)
        attempts = [] if told is not None else self._attempts_of(cur, row.id)
        if told is None:
            told = self._adopted_or_poisoned_in(cur, row, ask, now, attempts)
        if told is not None:
            replay = 1 if told.decision is Decision.REPLAY else 0
            cur.run(sql.COUNT_DELIVERY, {"replay": replay, "now": stamp, "operation_id": row.id})
            return told
        return self._take_run_in(cur, row, ask, now, attempts)

    @staticmethod
    def _finished_or_busy(row: _Row, ask: _Ask, now: datetime) -> OperationStart | None:
        """A finished operation replays or fails; another run's live lease says wait."""
        if row.status == OperationStatus.SUCCEEDED:
            # A result purged after its retention replays as None.
            return OperationStart(
                Decision.REPLAY, row.id, ask.key, runs=row.runs, result=_decode(row.result)
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

    def _adopted_or_poisoned_in(
        self, cur: Cursor, row: _Row, ask: _Ask, now: datetime, attempts: list[AttemptRef]
    ) -> OperationStart | None:
        """An answer reconciliation found is adopted; too many dead runs stop the
        message. None: the delivery runs."""
        stamp = self._driver.ts(now)
        mine = row.run_by(ask.owner)
        concluded = self._conclusion(attempts)
        if concluded is not None and concluded[0] == OperationStatus.SUCCEEDED:
            # A reconciliation found the answer while no run could take it: adopt it.
            self._set(cur, row, concluded[0], stamp, result=concluded[1], run_ended=mine)
            return OperationStart(
                Decision.REPLAY, row.id, ask.key, runs=row.runs, result=_decode(concluded[1])
            )
        if not mine and row.runs >= ask.max_runs:
            error = f"poison message: {row.runs} runs of {ask.key!r} never finished"
            resolutions = self._release_reserved(cur, attempts, stamp)
            self._set(cur, row, OperationStatus.FAILED, stamp, error=error, run_ended=False)
            for resolution in resolutions:
                resolution.apply(cur)
            return OperationStart(Decision.POISONED, row.id, ask.key, runs=row.runs, error=error)
        return None

    def _take_run_in(
        self, cur: Cursor, row: _Row, ask: _Ask, now: datetime, attempts: list[AttemptRef]
    ) -> OperationStart:
        """The lease for this delivery's run: renewed for its own owner, else taken (one
        more run)."""
        mine = row.run_by(ask.owner)
        expires = now + ask.lease
        params = {
            "expires": self._driver.ts(expires),
            "now": self._driver.ts(now),
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

    def end_run(
        self,
        operation: int | str,
        *,
        owner: str,
        status: str | None = None,
        error: str | None = None,
        next_reason: str | None = None,
        fallback: str = OperationStatus.PENDING,
    ) -> RunEnd:
        """Give back ``owner``'s lease on ``operation`` (its id once admitted; its key
        where the admission's answer was lost), ending the run.

        ``status`` ``failed`` ends the operation for good (the run knows it failed).
        Otherwise what it becomes is derived from its attempts (see the module), with
        ``fallback`` (``pending`` or ``retryable``) when they leave it open. Holds never
        granted a send are released. If the lease is no longer ``owner``'s, nothing
        changes while another run holds it live; once none does, the operation is
        concluded as beat would. Returns where the operation stands."""
        where = _operation_ref(operation)
        check.text(owner, "lease owner")
        if status is not None and status not in (
            OperationStatus.FAILED,
            OperationStatus.RETRYABLE,
            OperationStatus.PENDING,
        ):
            raise ValueError(f"a run cannot end its operation as {status!r}")
        if fallback not in (OperationStatus.PENDING, OperationStatus.RETRYABLE):
            raise ValueError(f"fallback must be pending or retryable, not {fallback!r}")
        now = self.now()
        stamp = self._driver.ts(now)
        with self._driver.transaction() as cur:
            row = self._lock_operation(cur, **where)
            end: RunEnd = self._end_in(
                cur,
                row,
                now,
                stamp,
                owner=owner,
                status=status,
                error=error,
                next_reason=next_reason,
                fallback=fallback,
            )
            return end

    def _end_in(
        self,
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
            return RunEnd(row.status, _decode(row.result), row.error, applied=False)
        mine = owner is not None and row.lease_owner == owner
        mine = mine and row.status == OperationStatus.RUNNING
        if not mine and lease_is_live(row.lease_owner, row.lease_expires_at, now):
            return RunEnd(row.status, None, row.error, applied=False)
        attempts = self._attempts_of(cur, row.id)
        resolutions = self._release_reserved(cur, attempts, stamp)
        concluded = self._conclusion(attempts)
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
        applied = self._set(
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
        return RunEnd(target, _decode(result), error, applied=applied)

    def conclude_operation(
        self,
        key: str,
        *,
        fallback: str = OperationStatus.RETRYABLE,
        error: str | None = None,
        next_reason: str | None = None,
    ) -> RunEnd:
        """Bring an operation no live run holds in line with its attempts (beat and
        operators, after resolving one of its attempts). ``fallback`` (``retryable``,
        ``pending`` or ``failed``) applies when its attempts leave it open."""
        check.text(key, "idempotency key")
        now = self.now()
        stamp = self._driver.ts(now)
        with self._driver.transaction() as cur:
            row = self._lock_operation(cur, key=key)
            end: RunEnd = self._conclude_in(cur, row, now, stamp, fallback, error, next_reason)
            return end

    def _conclude_in(
        self,
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
            attempts = self._attempts_of(cur, row.id)
            concluded = self._conclusion(attempts)
            if concluded is None and not row.finished:
                if lease_is_live(row.lease_owner, row.lease_expires_at, now):
                    return RunEnd(row.status, None, row.error, applied=False)
                resolutions = self._release_reserved(cur, attempts, stamp)
                applied = self._set(
                    cur, row, OperationStatus.FAILED, stamp, error=error, run_ended=False
                )
                for resolution in resolutions:
                    resolution.apply(cur)
                return RunEnd(OperationStatus.FAILED, None, error, applied=applied)
            fallback = OperationStatus.RETRYABLE
        end: RunEnd = self._end_in(
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

    def finish_operation(
        self,
        operation_id: int,
        *,
        result: Any,
        call: CallEnd | None = None,
        owner: str | None = None,
        encoded: str | None = None,
    ) -> RunEnd:
        """End a run that returned, in one transaction: write what its main ``call``
        came to (as :meth:`~budget_tasks.Ledger.end_call` does) and store the
        operation's result, which later deliveries replay.

        With ``owner``, the result is stored while that owner still holds the lease; if
        it does not, it is stored only if no live run holds the operation, it is
        unfinished and ``call`` is still its latest main-call attempt."""
        check.row_id(operation_id, "operation_id")
        encoded = self._kept(json.dumps(result) if encoded is None else encoded)
        now = self.now()
        stamp = self._driver.ts(now)
        if self._finished_alone(operation_id, call, owner, encoded, stamp):
            return RunEnd(OperationStatus.SUCCEEDED, json.loads(encoded), None, applied=True)
        with self._driver.transaction() as cur:
            row, ended = self._call_and_operation_in(cur, call, owner, stamp, op_id=operation_id)
            attempt = None if call is None else call.key
            end: RunEnd = self._store_result_in(cur, row, now, stamp, owner, attempt, encoded)
            self._apply_call(cur, ended)
        self._log_call(ended)
        return end

    def _finished_alone(
        self, operation_id: int, call: CallEnd | None, owner: str | None, encoded: str, stamp: Any
    ) -> bool:
        """:meth:`finish_operation`'s common case (the run's own main call settled) as
        one function call (see :mod:`.functions`); False where it is not that case or
        the function declined: the statement path decides."""
        if not self._functions or call is None or call.action != "settle" or owner is None:
            return False
        return self._settled_alone(
            call.key,
            call.actual,
            stamp,
            estimate_only=call.estimate_only,
            ids=call.ids,
            operation_id=operation_id,
            owner=owner,
            result=encoded,
        )

    def _call_and_operation_in(
        self,
        cur: Cursor,
        call: CallEnd | None,
        owner: str | None,
        stamp: Any,
        *,
        key: str | None = None,
        op_id: int = 0,
    ) -> tuple[_Row, tuple[_Resolution | None, bool] | None]:
        """Write what ``call`` came to under ``owner``'s lease and lock its operation
        (by ``key`` or ``op_id``), the attempt locked first: the order every writer
        locks them in."""
        if call is None:
            return self._lock_operation(cur, key=key, op_id=op_id), None
        if call.action == "settle":
            # a settlement lands whoever holds the lease, and locks its attempt itself
            ended = self._end_call_in(cur, call, stamp, lease_mine=True)
            return self._lock_operation(cur, key=key, op_id=op_id), ended
        if not cur.all(sql.LOCK_ATTEMPT, {"key": call.key}):
            if call.action == "unsent":  # the admission never committed
                return self._lock_operation(cur, key=key, op_id=op_id), None
            raise UnknownAttempt(call.key)
        row = self._lock_operation(cur, key=key, op_id=op_id)
        mine = owner is None or row.lease_owner == owner
        return row, self._end_call_in(cur, call, stamp, lease_mine=mine)

    @staticmethod
    def _apply_call(cur: Cursor, ended: tuple[_Resolution | None, bool] | None) -> bool:
        """Apply a call's resolution to the counters (last: the budget rows are the
        contended ones); whether anything changed."""
        if ended is None:
            return False
        resolution, changed = ended
        if resolution is None:
            return changed
        resolution.apply(cur)
        return resolution.applied

    def _log_call(self, ended: tuple[_Resolution | None, bool] | None) -> None:
        """Once its transaction committed: a call charged above its hold is an overrun."""
        resolution = None if ended is None else ended[0]
        if resolution is not None and resolution.applied and resolution.actual > resolution.amount:
            self._log_overrun(resolution.key, resolution.amount, resolution.actual)

    def _store_result_in(
        self,
        cur: Cursor,
        row: _Row,
        now: datetime,
        stamp: Any,
        owner: str | None,
        attempt: str | None,
        encoded: str,
    ) -> RunEnd:
        if row.finished:
            return RunEnd(row.status, _decode(row.result), row.error, applied=False)
        mine = owner is None or row.run_by(owner)
        attempts = self._attempts_of(cur, row.id)
        if not mine:
            if lease_is_live(row.lease_owner, row.lease_expires_at, now):
                return RunEnd(row.status, None, row.error, applied=False)
            latest = next((a for a in attempts if a.label is None), None)
            if attempt is not None and (latest is None or latest.key != attempt):
                return RunEnd(row.status, None, row.error, applied=False)
        resolutions = self._release_reserved(cur, attempts, stamp)
        applied = self._set(
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

    def fail_operation(
        self, operation_id: int, *, owner: str, error: str, call: CallEnd | None = None
    ) -> RunEnd:
        """End ``owner``'s run as failed for good, writing what its main ``call`` came
        to (as :meth:`~budget_tasks.Ledger.end_call` does), in one transaction (see
        :meth:`end_run` for a lease no longer ``owner``'s)."""
        check.row_id(operation_id, "operation_id")
        now = self.now()
        stamp = self._driver.ts(now)
        with self._driver.transaction() as cur:
            row, ended = self._call_and_operation_in(cur, call, owner, stamp, op_id=operation_id)
            end: RunEnd = self._end_in(
                cur,
                row,
                now,
                stamp,
                owner=owner,
                status=OperationStatus.FAILED,
                error=error,
                next_reason=None,
                fallback=OperationStatus.PENDING,
            )
            self._apply_call(cur, ended)
        self._log_call(ended)
        return end
