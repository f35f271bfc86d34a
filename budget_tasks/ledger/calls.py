"""What sends billable calls uses (``ledger.calls``): an attempt's hold, its one grant
of a send, what it is, and its settlement (the hold API of a ledger used without
Celery); and the protocol a delivery runs on: admit an operation's run and its calls,
end each call, end the run; side effects (``once()``) by name.

Each call is its own attempt, admitted in one transaction and settled, with its stored
result, in another; a redelivery replays it by its position in the run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from .. import _validate as check
from .._trust import Bound
from ..errors import (
    BudgetExceeded,
    BudgetFrozen,
    InvalidTransition,
    UnknownAttempt,
    UnknownOperation,
)
from . import holds, operations
from . import statements as sql
from .driver import Cursor
from .holds import CallPlan, check_reservation
from .operations import (
    Ask,
    Decision,
    OperationStart,
    Refused,
    RunEnd,
    check_delivery,
    decode,
    operation_ref,
)
from .records import (
    Answered,
    AttemptRef,
    CallAdmission,
    CallAsk,
    CallEnd,
    CallFacts,
    RateSeen,
    Reservation,
    SettledCall,
)
from .states import OperationStatus
from .store import HoldPlan, Store, attempt_row, bound_params

#: A labelled call asked with its run's admission: what it asks, where its answer is
#: stored, and the plan of the attempt to make at its position.
FirstCall = tuple[CallAsk, str, CallPlan]


def _step_of(cur: Cursor, operation_id: int, step: str) -> tuple[AttemptRef | None, int]:
    row = cur.one(sql.STEP_ATTEMPT, {"operation_id": operation_id, "step": step})
    if row is None:
        return None, 0
    akey, state, amount, reason, answer, recorded, count = row
    return AttemptRef(akey, state, amount, reason, step, answer, recorded), int(count)


def _labelled_in(
    store: Store,
    cur: Cursor,
    operation_id: int,
    call: CallAsk,
    record: str,
    chain: Any,
    found: HoldPlan,
    now: datetime,
    plan: CallPlan,
    *,
    created: bool = False,
    before_money: Callable[[], None] | None = None,
) -> CallAdmission:
    """A labelled call's admission in the caller's transaction (see
    :meth:`CallLedger.admit_call`); ``created``: its operation was created in this
    transaction, so nothing is stored or attempted at its position yet."""
    assert call.step is not None
    here = CallAdmission(operation_id)
    if not created:
        stored = cur.one(sql.SIDE_EFFECT, {"operation_id": operation_id, "name": record})
        if stored is not None and stored[0] == "done":
            return CallAdmission(operation_id, stored=(stored[0], decode(stored[1])))
        latest, count = _step_of(cur, operation_id, call.step)
        here = CallAdmission(operation_id, latest, count)
    return holds.admit_call_in(store, cur, call, here, chain, found, now, plan, before_money)


def _check_labelled(call: CallAsk, record: str) -> None:
    if call.step is None:
        raise ValueError("a labelled call names its step")
    check.text(record, "side effect name")


class CallLedger:
    """What sends billable calls uses (``ledger.calls``; see the module)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"CallLedger({self._store.url!r})"

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._store.url

    def now(self) -> datetime:
        """The ledger's time (see :meth:`~budget_tasks.Ledger.now`)."""
        return self._store.now()

    def provider_key(self, key: str) -> str:
        """What the provider is sent as attempt ``key``'s key (see
        :meth:`~budget_tasks.Ledger.provider_key`)."""
        return self._store.provider_key(key)

    def rate_turn(self, key: str) -> float | None:
        """Seconds until the call waiting in its rate windows' line under ``key`` has
        its turn, as the windows stand now (0: it has come; None: nothing is booked
        under it). A read: nothing is taken or written."""
        turn = self._store.rate_turn(key)
        return None if turn is None else turn.wait_ms / 1000

    def mark_unknown(
        self,
        key: str,
        reason: str,
        *,
        recorded_actual: int | None = None,
        request_id: str | None = None,
        response_id: str | None = None,
    ) -> bool:
        """sending -> unknown: the outcome is unknown and the hold stays (see
        :func:`.holds.mark_unknown`)."""
        return holds.mark_unknown(
            self._store,
            key,
            reason,
            recorded_actual=recorded_actual,
            request_id=request_id,
            response_id=response_id,
        )

    def release(
        self,
        key: str,
        reason: str,
        *,
        expected: str | None = None,
        seen: RateSeen | None = None,
    ) -> bool:
        """Drop the hold without a charge (see :func:`.holds.release`)."""
        return holds.release(self._store, key, reason, expected=expected, seen=seen)

    def reserve(
        self,
        budget: str,
        key: str,
        amount: int,
        *,
        fingerprint: str | None = None,
        reason: str = "first",
        price_version: str | None = None,
        operation_id: int | None = None,
        label: str | None = None,
        step: str | None = None,
        grant: CallFacts | None = None,
    ) -> Reservation:
        """Hold ``amount`` on ``budget`` and every ancestor for the attempt ``key``.

        Admits only if ``spent + held + amount <= cap`` in the current period of each
        budget in the chain, each checked and written by one conditional UPDATE, in
        budget-id order, in one transaction. Permission to send exists once this
        returns with ``created=True``. An existing key returns its reservation with
        ``created=False``; another budget, amount or fingerprint raises
        IdempotencyConflict. ``reason`` says why the attempt exists (first, redelivery,
        rate_limited_retry, unknown_resend, manual); ``price_version`` records the price
        table the amount was estimated from. With ``grant`` (what the call is, possibly
        nothing: ``CallFacts()``), the send is granted in the same transaction: the
        attempt is ``sending`` and no ``mark_sending`` follows.
        """
        check_reservation(budget, key, amount, fingerprint, price_version, label, step, reason)
        if operation_id is not None:
            check.row_id(operation_id, "operation_id")
        chain = self._store.admission_chain(budget)
        row = attempt_row(
            chain,
            key,
            amount,
            reason,
            fingerprint=fingerprint,
            price_version=price_version,
            operation_id=operation_id,
            label=label,
            step=step,
        )

        def admission(cur: Cursor, found: HoldPlan | None, now: datetime) -> Reservation:
            assert found is not None  # a chain has its periods
            return self._store.reserve_in(cur, chain, found, row, now, grant)

        try:
            if self._store.use_functions:
                alone = holds.reserved_alone(self._store, chain, row, grant)
                if alone is not None:
                    return alone
            return self._store.admitting(chain, admission)
        except self._store.driver.integrity as exc:
            if operation_id is None:
                raise
            # the one reference the caller gives: an operation that does not exist
            raise UnknownOperation(f"id {operation_id}") from exc

    def mark_sending(
        self, key: str, *, provider: str | None = None, request_id: str | None = None
    ) -> None:
        """reserved -> sending. The one grant of a send: a second call raises."""
        check.text(key, "key")
        check.optional_text(provider, "provider", max_length=64)
        check.optional_text(request_id, "request_id")
        params = {
            "key": key,
            "now": self._store.driver.ts(self._store.now()),
            "provider": provider,
            "request_id": request_id,
        }
        with self._store.driver.transaction() as cur:
            if cur.one(sql.MARK_SENDING, params) is None:
                state = cur.one(sql.ATTEMPT_STATE, {"key": key})
                if state is None:
                    raise UnknownAttempt(key)
                raise InvalidTransition(key, state[0], "mark sending")

    def record_call(
        self,
        key: str,
        *,
        request_id: str | None = None,
        response_id: str | None = None,
        cost: int | None = None,
    ) -> None:
        """Record what a finished call reported, at once and in one statement: its
        request and response ids and its priced usage, added to the attempt's recorded
        usage (a recorded actual is proof of billing: the attempt is never released, and
        never settled below it)."""
        check.text(key, "key")
        check.optional_text(request_id, "request_id")
        check.optional_text(response_id, "response_id")
        if cost is not None:
            check.money(cost, "cost")
        params = {"key": key, "request_id": request_id, "response_id": response_id, "cost": cost}
        with self._store.driver.transaction() as cur:
            if cur.one(sql.RECORD_CALL, params) is not None:
                return
            state = cur.one(sql.ATTEMPT_STATE, {"key": key})
        if state is None:
            raise UnknownAttempt(key)
        raise InvalidTransition(key, state[0], "record a call's outcome")

    def record_request_id(self, key: str, request_id: str) -> None:
        """Store the provider's request id (as soon as it is known, for reconciliation)."""
        check.text(key, "key")
        check.text(request_id, "request_id")
        with self._store.driver.transaction() as cur:
            if cur.one(sql.RECORD_REQUEST_ID, {"key": key, "request_id": request_id}):
                return
            row = cur.one(sql.ATTEMPT_REQUEST_ID, {"key": key})
        if row is None:
            raise UnknownAttempt(key)
        state, recorded = row
        if recorded == request_id:
            return
        if recorded is not None:
            raise InvalidTransition(
                key, state, f"replace request id {recorded!r} by {request_id!r}"
            )
        raise InvalidTransition(key, state, "record a request id before sending")

    def settle(
        self,
        key: str,
        actual: int,
        *,
        estimate_only: bool = False,
        note: str | None = None,
        expected: str | None = None,
        request_id: str | None = None,
        response_id: str | None = None,
        answered: Answered | None = None,
    ) -> bool:
        """Replace the hold by the actual charge: ``held -= reserved; spent += actual``.

        True if applied; False if already settled with this actual. Another actual
        raises SettlementConflict. An actual above the reservation is recorded as it
        is and logged as an overrun; one below the usage the run recorded raises
        UsageRecorded. ``note`` goes into the journal entry (an operator's resolution
        says so there). With ``expected``, only from that state (compare-and-set: the
        state the caller read); another raises InvalidTransition. The call's request and
        response ids, and what else its answer said (``answered``: its tokens), where
        given, are written with it.
        """
        check.text(key, "key")
        check.money(actual, "actual")
        check.optional_text(note, "note", max_length=10_000)
        said = answered or Answered()
        if request_id is not None or response_id is not None:
            said = dataclasses.replace(
                said,
                request_id=request_id or said.request_id,
                response_id=response_id or said.response_id,
            )
        if self._store.use_functions and expected in (None, "sending"):
            stamp = self._store.driver.ts(self._store.now())
            if self._store.settled_alone(
                key, actual, stamp, estimate_only=estimate_only, note=note, answered=said
            ):
                return True
        applied, amount = self._store.resolve(
            key,
            actual,
            "settled",
            "charge",
            note,
            estimate_only=estimate_only,
            expected=expected,
            answered=said,
        )
        if applied and actual > amount:
            self._store.log_overrun(key, amount, actual)
        return applied

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
        first: FirstCall | None = None,
    ) -> OperationStart:
        """One delivery's admission in one transaction: a finished key replays (one
        statement); otherwise the delivery is recorded and decided (see
        :class:`Decision`; a live lease's own owner may call again and keeps it without
        counting another run). When it may run, its main ``call`` (call 0) is admitted
        as any call is (see :meth:`admit_call`): where
        ``plan`` names its attempt, that attempt is reserved on the call's budget chain,
        granted and described in this commit. ``start.call`` says what was found and
        made; a budget that does not exist admits nothing (``plan`` is not asked).

        With ``first`` (a labelled call on the main call's budget: what it asks, its
        record, its plan), a run that defers its lease to its first call commits once
        before that call is sent: where this delivery creates the operation, that
        call is admitted instead of the main call (``start.call`` is None: a main
        call that reserves nothing needs no attempt), as :meth:`admit_call` would
        (``start.first``). Where the operation existed, what an earlier run left
        decides the run's reasons and its calls' (a retry after a 429, an operator's
        reopen): the main call is admitted as without ``first``, which its caller
        then admits on its own.

        A refusal (BudgetExceeded, BudgetFrozen) rolls the whole transaction back; the
        operation is then recorded pending with the refusal, in one more statement
        that is the delivery's only commit, and the refusal raised."""
        ask = Ask(key, fingerprint, owner, lease, max_runs, task, payload)
        check_delivery(ask)
        if first is not None:
            _check_labelled(first[0], first[1])
            if call is None or first[0].budget != call.budget:
                raise ValueError("a first call is admitted on its run's main call's budget")
        chain = None if call is None else operations.chain_or_none(self._store, call.budget)
        if self._store.use_functions:
            if first is None:
                alone = operations.admitted_alone(self._store, ask, call, chain, plan)
            else:
                # a first delivery's one attempt is its first call's (the function
                # declines a key that exists: the statement path decides that)
                alone = operations.admitted_alone(self._store, ask, first[0], chain, first[2])
                if alone is not None and alone.decision is Decision.RUN:
                    alone = replace(alone, call=None, first=alone.call, created=True)
            if alone is not None:
                return alone

        def admission(cur: Cursor, found: HoldPlan | None, now: datetime) -> OperationStart:
            start = operations.begin_or_replay_in(self._store, cur, ask, now)
            if start.call is None or call is None or chain is None or found is None:
                return start
            if first is not None and start.created:
                try:
                    made_first = _labelled_in(
                        self._store,
                        cur,
                        start.operation_id,
                        *first[:2],
                        chain,
                        found,
                        now,
                        first[2],
                        created=True,
                    )
                except (BudgetExceeded, BudgetFrozen) as exc:
                    raise Refused(exc) from exc
                return replace(start, call=None, first=made_first)
            if plan is None:
                return start
            try:
                made = holds.admit_call_in(
                    self._store, cur, call, start.call, chain, found, now, plan
                )
            except (BudgetExceeded, BudgetFrozen) as exc:
                raise Refused(exc) from exc
            return replace(start, call=made)

        try:
            return self._store.admitting(chain, admission)
        except Refused as refused:
            operations.record_refusal(
                self._store, key, fingerprint, task, payload, str(refused.exc)
            )
            raise refused.exc from None

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
        where = operation_ref(operation)
        check.text(owner, "lease owner")
        if status is not None and status not in (
            OperationStatus.FAILED,
            OperationStatus.RETRYABLE,
            OperationStatus.PENDING,
        ):
            raise ValueError(f"a run cannot end its operation as {status!r}")
        if fallback not in (OperationStatus.PENDING, OperationStatus.RETRYABLE):
            raise ValueError(f"fallback must be pending or retryable, not {fallback!r}")
        now = self._store.now()
        stamp = self._store.driver.ts(now)
        with self._store.driver.transaction() as cur:
            row = operations.lock_operation(self._store, cur, **where)
            end: RunEnd = operations.end_in(
                self._store,
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

    def finish_operation(
        self,
        operation_id: int,
        *,
        result: Any,
        call: CallEnd | None = None,
        owner: str | None = None,
        encoded: str | None = None,
        settled: Sequence[SettledCall] = (),
    ) -> RunEnd:
        """End a run that returned, in one transaction: settle its ``settled`` calls
        with their answers, write what its main ``call`` came to (as
        :meth:`~budget_tasks.Ledger.end_call` does) and store the operation's result,
        which later deliveries replay.

        With ``owner``, the result is stored while that owner still holds the lease; if
        it does not, it is stored only if no live run holds the operation, it is
        unfinished and ``call`` is still its latest main-call attempt."""
        check.row_id(operation_id, "operation_id")
        encoded = self._store.kept_text(json.dumps(result) if encoded is None else encoded)
        now = self._store.now()
        stamp = self._store.driver.ts(now)
        if operations.finished_alone(
            self._store, operation_id, call, owner, encoded, stamp, settled
        ):
            return RunEnd(OperationStatus.SUCCEEDED, json.loads(encoded), None, applied=True)
        with self._store.driver.transaction() as cur:
            before = operations.settle_calls_in(self._store, cur, operation_id, settled, stamp)
            row, ended = operations.call_and_operation_in(
                self._store, cur, call, owner, stamp, op_id=operation_id
            )
            attempt = None if call is None else call.key
            end: RunEnd = operations.store_result_in(
                self._store, cur, row, now, stamp, owner, attempt, encoded
            )
            for each in (*before, ended):
                operations.apply_call(cur, each)
        for each in (*before, ended):
            operations.log_call(self._store, each)
        return end

    def fail_operation(
        self, operation_id: int, *, owner: str, error: str, call: CallEnd | None = None
    ) -> RunEnd:
        """End ``owner``'s run as failed for good, writing what its main ``call`` came
        to (as :meth:`~budget_tasks.Ledger.end_call` does), in one transaction (see
        :meth:`end_run` for a lease no longer ``owner``'s)."""
        check.row_id(operation_id, "operation_id")
        now = self._store.now()
        stamp = self._store.driver.ts(now)
        with self._store.driver.transaction() as cur:
            row, ended = operations.call_and_operation_in(
                self._store, cur, call, owner, stamp, op_id=operation_id
            )
            end: RunEnd = operations.end_in(
                self._store,
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
            operations.apply_call(cur, ended)
        operations.log_call(self._store, ended)
        return end

    def admit_call(
        self,
        operation_id: int,
        call: CallAsk,
        *,
        record: str,
        plan: CallPlan,
        settled: Sequence[SettledCall] = (),
    ) -> CallAdmission:
        """A labelled call's admission in one transaction, as the main call's is in
        :meth:`admit`: its stored answer if it completed before (under ``record``);
        else what its position holds (its latest attempt, how many it has had) and,
        where ``plan`` names the attempt to make, that attempt reserved, granted and
        described. The run's ``settled`` calls are settled first, in the same commit
        (what they free counts for this call). A refusal raises and writes nothing,
        those settlements included."""
        check.row_id(operation_id, "operation_id")
        _check_labelled(call, record)
        chain = self._store.admission_chain(call.budget)
        ended: list[tuple[Any, bool] | None] = []

        def admission(cur: Cursor, found: HoldPlan | None, now: datetime) -> CallAdmission:
            assert found is not None  # a chain has its periods
            stamp = self._store.driver.ts(now)
            ended[:] = operations.settle_calls_in(self._store, cur, operation_id, settled, stamp)
            applied: list[bool] = []

            def apply_settled() -> None:
                # the settled calls' budget rows: after the new call's rate windows (every
                # window before any budget row), before its money (what they free counts)
                if not applied:
                    applied.append(True)
                    for each in ended:
                        operations.apply_call(cur, each)

            here = _labelled_in(
                self._store,
                cur,
                operation_id,
                call,
                record,
                chain,
                found,
                now,
                plan,
                before_money=apply_settled,
            )
            apply_settled()  # where no attempt was made
            return here

        here = self._store.admitting(chain, admission)
        for each in ended:
            operations.log_call(self._store, each)
        return here

    def side_effect(self, operation_id: int, name: str) -> tuple[str, Any] | None:
        """``(state, result)`` of a side effect, or None if it never started."""
        with self._store.driver.transaction() as cur:
            row = cur.one(sql.SIDE_EFFECT, {"operation_id": operation_id, "name": name})
        if row is None:
            return None
        state, result = row
        return state, None if result is None else json.loads(result)

    def start_side_effect(self, operation_id: int, name: str) -> bool:
        """Claim the side effect; False if it was claimed before (done or not)."""
        check.text(name, "side effect name")
        stamp = self._store.driver.ts(self._store.now())
        with self._store.driver.transaction() as cur:
            row = cur.one(
                sql.START_SIDE_EFFECT,
                {"operation_id": operation_id, "name": name, "now": stamp},
            )
        return row is not None

    def finish_side_effect(self, operation_id: int, name: str, result: Any) -> None:
        """Store the side effect's result: later runs get it instead of running it."""
        encoded = self._store.kept_text(json.dumps(result))
        stamp = self._store.driver.ts(self._store.now())
        with self._store.driver.transaction() as cur:
            cur.run(
                sql.FINISH_SIDE_EFFECT,
                {"operation_id": operation_id, "name": name, "result": encoded, "now": stamp},
            )

    def forget_side_effect(self, operation_id: int, name: str) -> None:
        """Drop a claim whose function raised, so that a later run may try again."""
        with self._store.driver.transaction() as cur:
            cur.run(sql.FORGET_SIDE_EFFECT, {"operation_id": operation_id, "name": name})

    def end_call(
        self,
        call: CallEnd,
        *,
        operation_id: int | str,
        owner: str,
        record: str | None = None,
        result: Any = None,
    ) -> bool:
        """Write what one ``call`` of ``owner``'s run came to, the main call or a
        labelled one, in one transaction; with ``record``, ``result`` is stored under
        it for replay. ``operation_id``: the operation's id, or its key where its
        admission's answer was lost before it had an id.

        A write kept through an outage may land after the run's lease moved on. A
        settlement lands all the same (it is what the provider billed: an attempt
        resolved meanwhile keeps the larger charge), and so does its result; a release
        or an unknown lands only while ``owner`` still holds the lease: once another
        run has taken the operation, that run or reconciliation decides the hold, and
        False is returned. False too where nothing changed."""
        where = operation_ref(operation_id)
        check.text(owner, "lease owner")
        encoded = None if record is None else self._store.kept_text(json.dumps(result))
        stamp = self._store.driver.ts(self._store.now())
        with self._store.driver.transaction() as cur:
            row, ended = operations.call_and_operation_in(
                self._store, cur, call, owner, stamp, **where
            )
            if ended is None:
                return False
            if record is not None and encoded is not None:
                operations.store_answer_in(cur, row.id, record, encoded, stamp)
            changed = operations.apply_call(cur, ended)
        operations.log_call(self._store, ended)
        return changed

    def describe_attempt(
        self,
        key: str,
        *,
        lookup: str | None = None,
        model: str | None = None,
        response_id: str | None = None,
        timeout: float | None = None,
        request: str | None = None,
        bound: Bound | None = None,
    ) -> None:
        """Record what a call is (which lookup finds it, the model it is priced at, the
        provider's response id, the client timeout it is sent with, its request's
        digest, the most tokens it allows), for reconciliation if its outcome becomes
        unknown."""
        check.text(key, "key")
        facts = CallFacts(lookup, model, timeout, request, bound)
        timeout_ms = facts.timeout_ms
        values = {
            name: value
            for name, value in (
                ("lookup", lookup),
                ("model", model),
                ("response_id", response_id),
                ("request_digest", request),
            )
            if value is not None
        }
        if response_id is not None:
            check.text(response_id, "response_id", max_length=255)
        if not values and timeout_ms is None and bound is None:
            return
        params = {
            "key": key,
            "lookup": None,
            "model": None,
            "response_id": None,
            "request_digest": None,
            "timeout_ms": timeout_ms,
            **bound_params(facts),
            **values,
        }
        with self._store.driver.transaction() as cur:
            changed = cur.run(sql.DESCRIBE_ATTEMPT, params)
        if not changed:
            raise UnknownAttempt(key)
