"""One delivery of an operation, as a state machine on the ledger (no Celery here).

:class:`OperationManager` runs the flow that ``BudgetTask.__call__`` drives: look the
operation up, replay or wait or stop, decide what the last run left behind, reserve,
run, then settle and store. Every write it makes is compare-and-set in the ledger;
when one finds another state, the manager re-reads and acts on what is there.

The rules for money, whatever ``run`` does:

- a run (and each ``spend`` block) is granted its send when its reservation commits;
  a run that returns is charged what its calls reported, or its whole reservation if
  they reported nothing; one that fails before it ever asked for its key
  (``attempt.key``, ``call.key``) sent nothing under it and is released;
- a recorded actual is proof of billing: it is written to the ledger at once, and the
  hold it belongs to is settled at it (never released), whatever happens after;
- an error while a call is out keeps that call's hold as unknown unless the error says
  the provider certainly did not bill (4xx, 429, a refused connection, NotBilled);
- an operation with billed calls that a new run would send again is not run again
  automatically (``rerun_billed`` says otherwise): it ends failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from .. import _validate as check
from ..errors import (
    BudgetExceeded,
    BudgetFrozen,
    BudgetTasksError,
    IdempotencyConflict,
    InvalidTransition,
    LedgerUnavailable,
    OperationFailed,
    OperationInProgress,
    OutcomeUnknown,
    PoisonMessage,
    StepNotReplayable,
)
from ..hooks import Hooks, hooks
from ..ledger import CallEnd, CallFacts
from ..ledger.operations import AttemptRef, Decision, OperationStart, RunEnd, owner_id
from ..ledger.records import Reservation
from ..ledger.states import HOLDING, OPEN, AttemptState, OperationStatus, nothing_sent_under
from .fates import (
    ErrorKind,
    HoldFate,
    before_send,
    describe_error,
    error_kind,
    fate_after_error,
    fate_after_return,
)
from .keys import main_key, step_key
from .owed import Write, call_end, call_write, catch_up, end_write, owe, persist
from .scope import AttemptScope, Call

log = logging.getLogger("budget_tasks.delivery")

#: How many times a delivery re-reads after losing a compare-and-set before it gives
#: the message back for later.
MAX_REREADS = 3
#: What the result of a step replays as when its step is reconciled but none stored.
_STEP_RECORD = "spend:{label}:{seq}"


@dataclass(frozen=True)
class _Position:
    """One labelled call's place in its run: the label it counts under, its first
    attempt's key, the name its answer is stored under, and what it reserves."""

    label: str
    base: str
    record: str
    amount: int
    facts: CallFacts
    price_version: str | None


@dataclass(frozen=True)
class _RunEnd:
    """What an operation becomes when an error ends its run (None: derived from its
    attempts), why its next attempt runs, and why the message comes back later."""

    status: str | None
    next_reason: str | None = None
    later: str | None = None


#: tasks already warned that their main estimate paid for nothing (once per process)
_WARNED_UNUSED: set[str] = set()


class RetryLater(Exception):
    """Not an error: the delivery asks its driver to bring the message back later
    (``why``: ledger, in_progress, rate_limited, budget). ``cause`` is what to raise
    where there is no later (eager mode)."""

    def __init__(self, why: str, cause: BaseException) -> None:
        super().__init__(why, cause)
        self.why = why
        self.cause = cause


@dataclass
class DeliveryOptions:
    """A task's options that the flow reads (see BudgetTask)."""

    task: str
    on_unknown: str = "hold"
    max_deliveries: int = 5
    lease_seconds: float = 600.0
    retry_when_budget_frees: float = 0.0
    rerun_billed: bool = False
    price_version: str | None = None
    #: exceptions out of ``run`` by which a task asks to run again later (Celery's Retry)
    retry_types: tuple[type[BaseException], ...] = ()


@dataclass
class Delivery:
    """One delivery's facts: what the operation is and what the task gives."""

    key: str
    fingerprint: str
    budget: str
    estimate: Callable[[], int]
    run: Callable[[AttemptScope], Any]
    payload: Any = None
    owner: str = field(default_factory=owner_id)
    #: what the main call is, where the task knows it before ``run`` (written with the
    #: admission, so that describing it inside ``run`` writes nothing)
    describe: Callable[[], CallFacts | None] = lambda: None
    #: the broker delivered this message before (a worker died holding it)
    redelivered: bool = False


class OperationManager:
    """Runs deliveries of one task's operations on one ledger (see the module)."""

    def __init__(self, ledger: Any, options: DeliveryOptions, sink: Hooks = hooks) -> None:
        self.ledger = ledger
        self.options = options
        self.hooks = sink

    # -- one delivery ------------------------------------------------------------------

    def deliver(self, d: Delivery) -> Any:
        """Run one delivery to its end: the result (run or replayed), or an exception:
        RetryLater, or the error the operation ended with."""
        # A redelivered message may be one whose task code killed its worker before the
        # admission committed (estimate_cost itself): its lease is taken, and the run
        # counted, before any of that code runs again, so poison detection sees it.
        estimate, facts, failure = (None, None, None) if d.redelivered else self._estimate(d)
        for _ in range(MAX_REREADS):
            start = self._admit(d, estimate, facts)
            if start.decision is Decision.REPLAY:
                log.info("operation %s replayed: no provider call, no charge", d.key)
                self.hooks.replayed(task=self.options.task, operation=d.key)
                return start.result
            if start.decision is Decision.FAILED:
                raise OperationFailed(d.key, start.error)
            if start.decision is Decision.POISONED:
                log.error("operation %s stopped as a poison message: %s", d.key, start.error)
                raise PoisonMessage(d.key, start.error)
            if start.decision is Decision.IN_PROGRESS:
                raise RetryLater("in_progress", OperationInProgress(d.key))
            if estimate is None and failure is None:
                estimate, facts, failure = self._estimate(d)
            if failure is not None:
                self._end_quietly(
                    d, OperationStatus.PENDING, "estimate_cost or describe_call failed"
                )
                raise failure
            assert estimate is not None
            if start.reservation is not None:  # reserved and granted with the lease
                reservation = start.reservation
                self.hooks.admitted(budget=d.budget, attempt=reservation.key, amount=estimate)
                key, reason = reservation.key, reservation.reason
                return self._run(d, self._scope(d, start, key, estimate, reason, facts))
            try:
                prepared = self._prepare(d, start, estimate, facts)
            except _Replayed as replayed:
                return replayed.result
            if prepared is not None:
                return self._run(d, prepared)
        raise RetryLater("in_progress", OperationInProgress(d.key))

    @staticmethod
    def _estimate(d: Delivery) -> tuple[int | None, CallFacts | None, Exception | None]:
        """The task's estimate and call description, or what they raised: raised once
        the delivery turns out to run (a replay needs neither)."""
        try:
            return check.money(d.estimate(), "estimate_cost"), d.describe(), None
        except Exception as exc:
            return None, None, exc

    def _plan(self, start: OperationStart) -> tuple[str, str] | None:
        """The main attempt to reserve and grant with the lease, ``(key, reason)``; None
        where an earlier run left an attempt to decide first (see :meth:`_prepare`)."""
        last = start.last_attempt
        if start.open_steps or (last is not None and last.state in HOLDING):
            return None
        reason = start.next_reason or ("first" if start.attempts == 0 else "redelivery")
        return main_key(start.key, start.attempts + 1), reason

    def _admit(self, d: Delivery, estimate: int | None, facts: CallFacts | None) -> OperationStart:
        try:
            catch_up(self.ledger)
            return self.ledger.admit(  # type: ignore[no-any-return]
                d.key,
                fingerprint=d.fingerprint,
                owner=d.owner,
                lease=timedelta(seconds=self.options.lease_seconds),
                max_runs=self.options.max_deliveries,
                task=self.options.task,
                payload=d.payload,
                budget=d.budget if estimate is not None else None,
                amount=estimate,
                plan=self._plan,
                price_version=self.options.price_version,
                call=facts,
            )
        except (BudgetExceeded, BudgetFrozen) as exc:
            # Refused in the admission's transaction: the operation is pending again.
            self._denied(exc, estimate or 0)
            if self.options.retry_when_budget_frees:
                raise RetryLater("budget", exc) from exc
            raise
        except LedgerUnavailable as exc:
            # Fail closed: nothing is sent. The lease and a grant may have committed all
            # the same (a COMMIT whose answer was lost): this process, which knows it sent
            # nothing, gives them back once the ledger answers.
            owe(
                self.ledger,
                d.key,
                d.owner,
                [end_write(d.key, d.owner, OperationStatus.PENDING, str(exc), True)],
            )
            raise RetryLater("ledger", exc) from exc

    def _denied(self, exc: BudgetExceeded | BudgetFrozen, amount: int) -> None:
        self.hooks.denied(
            budget=exc.budget,
            reason="exceeded" if isinstance(exc, BudgetExceeded) else "frozen",
            amount=amount,
        )

    def _scope(
        self,
        d: Delivery,
        start: OperationStart,
        key: str,
        amount: int,
        reason: str,
        facts: CallFacts | None,
    ) -> AttemptScope:
        return AttemptScope(
            key,
            amount,
            self.ledger,
            reason=reason,
            operation_key=d.key,
            operation_id=start.operation_id,
            budget=d.budget,
            fingerprint=d.fingerprint,
            manager=self,
            owner=d.owner,
            described=facts,
        )

    def _prepare(
        self, d: Delivery, start: OperationStart, estimate: int, facts: CallFacts | None
    ) -> AttemptScope | None:
        """Everything before ``run``: settle what the last run left behind, decide the
        attempt, reserve it. None: the state moved under us; read again."""
        last = start.last_attempt
        reason = start.next_reason or ("first" if start.attempts == 0 else "redelivery")
        if (
            last is not None
            and last.state in OPEN
            and nothing_sent_under(d.key, last.label, last.amount, last.recorded_actual)
        ):
            # A dead run's main attempt of 0 is released and the run goes again; its
            # metered calls replay by position.
            try:
                self.ledger.release(
                    last.key, "a dead run's main attempt of 0: nothing sent", expected=last.state
                )
            except InvalidTransition:
                self._end(d, None)
                return None
            last = replace(last, state=AttemptState.RELEASED)
        left = [a for a in (last, *start.open_steps) if a is not None and a.state in OPEN]
        if left:
            if not self._adopt_all(left):
                self._end(d, None)
                return None
            if self.options.on_unknown != "resend":
                end = self._end(d, None)
                if end.status == OperationStatus.SUCCEEDED:
                    self.hooks.replayed(task=self.options.task, operation=d.key)
                    raise _Replayed(end.result)
                if end.status == OperationStatus.UNKNOWN or not end.applied:
                    raise OutcomeUnknown(d.key, left[0].key)
                return None  # resolved meanwhile: read again
            if last is not None and last.state in OPEN:
                reason = "unknown_resend"
        try:
            reuse = self._reuse_or_release(last, estimate)
        except InvalidTransition:
            self._end(d, None)
            return None
        key = reuse.key if reuse is not None else main_key(d.key, start.attempts + 1)
        if reuse is None and not self._reserve(d, key, estimate, reason, start.operation_id):
            return None
        if not self._grant(d, key):
            return None
        return self._scope(d, start, key, estimate, reason, None)

    def _grant(self, d: Delivery, key: str) -> bool:
        """reserved -> sending: the reservation is committed; this is the one grant of
        a send. False if the hold moved meanwhile (read again)."""
        try:
            self.ledger.mark_sending(key)
        except InvalidTransition:
            self._end(d, None)
            return False
        except LedgerUnavailable as exc:
            # Nothing is sent. The grant may have committed all the same (its answer
            # lost): this process, which knows nothing went out, releases it later.
            # Given back through the lease, compare-and-set: should the lease have moved
            # on meanwhile, another run may be sending under this very attempt.
            owe(
                self.ledger,
                d.key,
                d.owner,
                [end_write(d.key, d.owner, OperationStatus.PENDING, str(exc), unsent=True)],
            )
            raise RetryLater("ledger", exc) from exc
        return True

    def _adopt_all(self, attempts: list[AttemptRef]) -> bool:
        """Earlier attempts left open, of the main call or labelled ones: each found
        sending is adopted (see :meth:`_adopt`). False if any moved meanwhile."""
        return all(a.state != AttemptState.SENDING or self._adopt(a) for a in attempts)

    def _adopt(self, attempt: AttemptRef) -> bool:
        """A later delivery found ``attempt`` sending: its run is gone (the lease was
        not live), so its outcome is unknown. False if it moved meanwhile."""
        try:
            if self.ledger.mark_unknown(
                attempt.key, "a later delivery found it sending: worker lost"
            ):
                self.hooks.unknown(task=self.options.task, attempt=attempt.key)
        except InvalidTransition:
            return False
        return True

    def _reserve(
        self,
        d: Delivery,
        key: str,
        amount: int,
        reason: str,
        operation_id: int,
    ) -> bool:
        """Reserve the main attempt (the lease given back if refused)."""
        try:
            reservation = self._reserve_attempt(
                d.budget,
                key,
                amount,
                fingerprint=d.fingerprint,
                reason=reason,
                price_version=self.options.price_version,
                operation_id=operation_id,
            )
        except (BudgetExceeded, BudgetFrozen) as exc:
            self._end_quietly(d, OperationStatus.PENDING, str(exc))
            if self.options.retry_when_budget_frees:
                raise RetryLater("budget", exc) from exc
            raise
        except LedgerUnavailable as exc:
            # Nothing was sent: fail closed now, and let the message come back later.
            self._end_quietly(d, OperationStatus.PENDING, str(exc))
            raise RetryLater("ledger", exc) from exc
        except (BudgetTasksError, ValueError, TypeError) as exc:
            self._end_quietly(d, OperationStatus.PENDING, str(exc))
            raise
        if not reservation.created:
            # The key exists: never a second permission. Read again.
            self._end(d, None)
            return False
        return True

    def _reserve_attempt(self, budget: str, key: str, amount: int, **how: Any) -> Reservation:
        """Reserve a new attempt of any call, the main one or a labelled one, and tell
        the hooks: admitted, or denied (raised). Not ``created``: the key was there."""
        try:
            reservation: Reservation = self.ledger.reserve(budget, key, amount, **how)
        except (BudgetExceeded, BudgetFrozen) as exc:
            self._denied(exc, amount)
            raise
        if reservation.created:
            self.hooks.admitted(budget=budget, attempt=key, amount=amount)
        return reservation

    def _reuse_or_release(self, earlier: AttemptRef | None, amount: int) -> AttemptRef | None:
        """An earlier attempt of this call that was reserved and never sent is sent
        under as it is at the same amount; at another amount (re-estimated) it is
        released first. The same rule for the main call and a labelled one;
        InvalidTransition if it moved meanwhile."""
        if earlier is None or earlier.state != AttemptState.RESERVED:
            return None
        if earlier.amount == amount:
            return earlier
        self.ledger.release(earlier.key, "never sent; re-estimated", expected="reserved")
        return None

    def _run(self, d: Delivery, scope: AttemptScope) -> Any:
        try:
            result = d.run(scope)
        except BaseException as exc:
            return self._after_error(d, scope, exc)
        try:
            encoded = json.dumps(result)
        except Exception as exc:  # TypeError, ValueError, RecursionError, an encoder's own
            # The provider answered: its charge lands and the lease comes back.
            failure = TypeError(
                f"the result of {d.key} cannot be stored as JSON: {describe_error(exc)}"
            )
            return self._after_error(d, scope, failure, fate=fate_after_return(scope))
        return self._finish(d, scope, result, encoded)

    def _finish(self, d: Delivery, scope: AttemptScope, result: Any, encoded: str) -> Any:
        catch_up(self.ledger)  # what this run's labelled calls still owe goes first
        fate = fate_after_return(scope)
        self._warn_if_estimate_unused(scope, fate)
        # The provider was called: the outcome must land, so a short outage is waited
        # out. If it lasts, this process keeps it and writes it at its next delivery (the
        # lease is its own meanwhile); should this process die first, the attempt stays
        # 'sending' and is reconciled.
        kwargs = {
            "result": None,
            "encoded": encoded,
            "call": call_end(scope, fate),
            "owner": d.owner,
        }
        try:
            end = persist(self.ledger.finish_operation, d.key, **kwargs)
        except LedgerUnavailable as exc:
            owe(self.ledger, d.key, d.owner, [Write("finish_operation", {"key": d.key, **kwargs})])
            raise RetryLater("ledger", exc) from exc
        self._tell(d.budget, scope.attempt_key, scope.amount, fate)
        if not end.applied:
            if end.status == OperationStatus.SUCCEEDED:
                log.warning("operation %s was finished meanwhile: its stored result stands", d.key)
                return end.result
            log.warning(
                "operation %s: this run's charge landed, its result not (now %s)", d.key, end.status
            )
        return result

    def _warn_if_estimate_unused(self, scope: AttemptScope, fate: HoldFate) -> None:
        """Once per task: a main estimate charged in full with no call under the main
        attempt, while the run's calls were metered on their own (guarded client,
        spend()): each of those paid its own hold, so the estimate paid for nothing."""
        task = self.options.task
        if not (fate.estimate_only and scope.amount > 0 and scope.made_calls):
            return
        if scope.used or task in _WARNED_UNUSED:
            return
        _WARNED_UNUSED.add(task)
        log.warning(
            "task %s: its main estimate (%d) was charged in full with no call under the "
            "main attempt, while its calls were metered on their own (the guarded client, "
            "spend()); give it estimate_cost=0 if every call it makes is metered so",
            task,
            scope.amount,
        )

    def _after_error(
        self, d: Delivery, scope: AttemptScope, exc: BaseException, fate: HoldFate | None = None
    ) -> Any:
        """Write what an error out of ``run`` means, then raise what the task raises."""
        # A task that retries itself (self.retry, autoretry_for) leaves run with Celery's
        # Retry, raised while it handled the provider's error: that error says what the
        # call cost (a 429 was not billed), and the retry is already on its way.
        retried = isinstance(exc, self.options.retry_types)
        cause = exc.__context__ if retried and exc.__context__ is not None else exc
        fate = fate or fate_after_error(scope, cause)
        after = self._run_end(scope, cause, fate, retried)
        catch_up(self.ledger)  # what this run's labelled calls still owe goes first
        end = self._write_all(d, self._end_writes(d, scope, fate, after, describe_error(exc)))
        self._tell(d.budget, scope.attempt_key, scope.amount, fate)
        if end is None:  # the ledger is down: the writes are owed; bring the message back
            raise RetryLater("ledger", exc) from exc
        if end.status == OperationStatus.SUCCEEDED:
            # A reconciliation found the answer meanwhile; it is the operation's result.
            return end.result
        if after.later is not None and end.applied:
            raise RetryLater(after.later, exc) from exc
        raise exc

    def _run_end(
        self, scope: AttemptScope, cause: BaseException, fate: HoldFate, retried: bool
    ) -> _RunEnd:
        """What the operation becomes after ``cause`` ended its run, and whether the
        delivery brings the message back later (``retried``: the task already does)."""
        billed = fate.action == "settle" or scope.billed_unstored
        rerun_safe = not billed or self.options.rerun_billed
        if fate.action == "unknown" or scope.left_open or isinstance(cause, OutcomeUnknown):
            return _RunEnd(None)  # derived: unknown while a hold is open
        if isinstance(cause, LedgerUnavailable):
            return _RunEnd(OperationStatus.PENDING, later=None if retried else "ledger")
        kind = error_kind(cause)
        if kind is ErrorKind.NOT_SENT and rerun_safe:
            # no connection was made (refused, no such host): the work is not lost, and
            # the next delivery of the key (an enqueue, the task's own retry) runs it
            return _RunEnd(OperationStatus.RETRYABLE)
        if kind is ErrorKind.RATE_LIMITED and rerun_safe:
            return _RunEnd(
                OperationStatus.RETRYABLE,
                next_reason="rate_limited_retry",
                later=None if retried else "rate_limited",
            )
        if retried and rerun_safe:
            return _RunEnd(OperationStatus.PENDING)  # the task asked to run again later
        if isinstance(cause, BudgetExceeded | BudgetFrozen) and rerun_safe:
            later = "budget" if self.options.retry_when_budget_frees else None
            return _RunEnd(OperationStatus.PENDING, later=later)
        return _RunEnd(OperationStatus.FAILED)

    @staticmethod
    def _end_writes(
        d: Delivery, scope: AttemptScope, fate: HoldFate, after: _RunEnd, error: str
    ) -> list[Write]:
        """The main call's outcome and the run's end, as the writes that make them (a
        failed run settles its billed main call in the same commit as it fails)."""
        lease = {"key": d.key, "owner": d.owner, "error": error}
        if after.status == OperationStatus.FAILED:
            return [Write("fail_operation", {**lease, "call": call_end(scope, fate)})]
        outcome = call_write(scope, fate, operation_id=scope.operation_id, owner=d.owner)
        ending = {**lease, "status": after.status, "next_reason": after.next_reason}
        return [outcome, Write("end_run", ending)]

    def _write_all(self, d: Delivery, writes: list[Write]) -> RunEnd | None:
        end = None
        for i, write in enumerate(writes):
            try:
                end = write.apply(self.ledger)
            except LedgerUnavailable:
                owe(self.ledger, d.key, d.owner, writes[i:])
                return None
            except InvalidTransition as exc:
                log.warning("operation %s: %s moved meanwhile: %s", d.key, write.name, exc)
        return end if isinstance(end, RunEnd) else None

    def _tell(self, budget: str, attempt: str, amount: int, fate: HoldFate) -> None:
        """What a call's hold came to, for the hooks: the main call and a labelled one."""
        if fate.action == "unknown":
            self.hooks.unknown(task=self.options.task, attempt=attempt)
        elif fate.action == "settle":
            self.hooks.settled(
                budget=budget, attempt=attempt, amount=amount, actual=fate.actual, by="task"
            )
        else:
            self.hooks.released(budget=budget, attempt=attempt, amount=amount, by="task")

    def _end(self, d: Delivery, status: str | None, error: str | None = None) -> RunEnd:
        return self.ledger.end_run(d.key, owner=d.owner, status=status, error=error)  # type: ignore[no-any-return]

    def _end_quietly(self, d: Delivery, status: str, error: str) -> None:
        """Give the lease back; if the ledger is down, this process does at its next
        delivery (the lease names a live process: waiting for its expiry would hold the
        message off for a whole lease)."""
        try:
            self._end(d, status, error)
        except LedgerUnavailable:
            log.warning("operation %s: could not record %s yet (ledger down)", d.key, status)
            owe(self.ledger, d.key, d.owner, [end_write(d.key, d.owner, status, error)])

    # -- labelled calls ------------------------------------------------------------------

    @contextmanager
    def step(
        self,
        scope: AttemptScope,
        amount: int,
        label: str,
        call: CallFacts | None = None,
        price_version: str | None = None,
    ) -> Iterator[Call]:
        """One labelled billable call of ``scope``'s run as its own attempt (see
        ``BudgetTask.spend``); ``call``, where known, describes it with its admission;
        ``price_version`` names the prices its amount was estimated at (else the
        task's)."""
        check.text(label, "label", max_length=60)
        check.money(amount)
        facts = call or CallFacts()
        seq = scope.position(label, facts.request)
        base = step_key(scope.operation_key, label, seq)
        if len(base) + check.STEP_SUFFIX_ROOM > check.MAX_KEY_LENGTH:
            # refused before anything is reserved: the key could never be written
            raise ValueError(
                f"step {label!r} of operation {scope.operation_key[:40]!r}...: its attempt "
                f"keys would pass {check.MAX_KEY_LENGTH} characters; use a shorter label "
                "or idempotency key"
            )
        where = _Position(
            label,
            base,
            _STEP_RECORD.format(label=label, seq=seq),
            amount,
            facts,
            price_version or self.options.price_version,
        )
        made = self._open_call(scope, where)
        if made.replayed:
            yield made
            return
        try:
            yield made
        except BaseException as exc:
            self._call_failed(scope, where, made, exc)
            raise
        fate = fate_after_return(made)
        self._write_call(scope, made, fate, wait=True, record=where.record, result=made.result)
        if fate.action == "settle":
            self._tell(scope.budget, made.attempt_key, made.amount, fate)

    def _open_call(self, scope: AttemptScope, where: _Position) -> Call:
        """The call at ``where``: replayed, or granted its send."""
        try:
            found = self._step_attempt(scope, where)
            if isinstance(found, Call):
                return found
            key, granted = found
            if not granted:
                self.ledger.mark_sending(key)
        except LedgerUnavailable as exc:
            raise before_send(exc) from None
        described = where.facts if granted else None
        return Call(key, where.amount, where.label, self.ledger, described=described)

    def _call_failed(
        self, scope: AttemptScope, where: _Position, made: Call, exc: BaseException
    ) -> None:
        """Write what an error inside a labelled call's block means for its hold."""
        fate = fate_after_error(made, exc)
        if fate.action == "settle":
            scope.billed_unstored = True
        elif fate.action == "unknown":
            scope.left_open = True
        self._write_call(scope, made, fate, wait=False)
        self._tell(scope.budget, made.attempt_key, made.amount, fate)
        if fate.action == "release":
            scope.refused(where.label, where.facts.request)

    def _write_call(
        self, scope: AttemptScope, call: Call, fate: HoldFate, *, wait: bool, **stored: Any
    ) -> None:
        """Write what a labelled call came to (with its result, where it returned). As
        for the main call: a call that returned waits out a short outage (``wait``),
        one that raised does not (its run is ending); past that, this process owes the
        write and makes it before its run's end, or at its next delivery."""
        write = call_write(call, fate, operation_id=scope.operation_id, owner=scope.owner, **stored)
        try:
            if wait:
                persist(getattr(self.ledger, write.name), **write.kwargs)
            else:
                write.apply(self.ledger)
        except LedgerUnavailable:
            log.warning(
                "operation %s: call %s kept back (ledger down)",
                scope.operation_key,
                call.attempt_key,
            )
            owe(self.ledger, scope.operation_key, scope.owner, [write])

    def _step_attempt(self, scope: AttemptScope, where: _Position) -> Call | tuple[str, bool]:
        """A replayed call, or the key of the attempt this call sends under and whether
        it was granted with its admission."""

        def plan(latest: AttemptRef | None, count: int) -> tuple[str, str] | None:
            # a new attempt at once where nothing earlier is left to decide
            if latest is None:
                return where.base, scope.reason
            if latest.state == AttemptState.RELEASED:
                return f"{where.base}~{count + 1}", "redelivery"
            return None

        try:
            admission = self.ledger.admit_step(
                scope.operation_id,
                where.base,
                where.record,
                budget=scope.budget,
                amount=where.amount,
                fingerprint=scope.fingerprint,
                label=where.label,
                plan=plan,
                price_version=where.price_version,
                call=where.facts,
            )
        except (BudgetExceeded, BudgetFrozen) as exc:
            self._denied(exc, where.amount)
            raise
        if admission.stored is not None:
            stored = admission.stored[1]
            return Call(where.base, where.amount, where.label, replayed=True, result=stored)
        if admission.reservation is not None:
            reservation = admission.reservation
            if not reservation.created:
                raise IdempotencyConflict(
                    reservation.key, "attempt", reservation.state, "a new attempt"
                )
            self.hooks.admitted(budget=scope.budget, attempt=reservation.key, amount=where.amount)
            return reservation.key, True
        latest, count = admission.latest, admission.count
        if latest is not None and latest.state == AttemptState.SETTLED and latest.answer:
            return self._found_call(scope, where, latest)
        reason, reuse = self._after_earlier(scope, where, latest)
        if reuse is not None:
            return reuse.key, False
        key = where.base if count == 0 else f"{where.base}~{count + 1}"
        self._reserve_call(scope, where, key, reason)
        return key, False

    def _found_call(self, scope: AttemptScope, where: _Position, latest: AttemptRef) -> Call:
        """Reconciliation found this call's answer: that is what it replays."""
        answer = json.loads(latest.answer or "null")
        self.ledger.end_call(
            CallEnd(latest.key, "store"),
            operation_id=scope.operation_id,
            owner=scope.owner,
            record=where.record,
            result=answer,
        )
        return Call(
            latest.key, where.amount, where.label, replayed=True, result=answer, reconciled=True
        )

    def _after_earlier(
        self, scope: AttemptScope, where: _Position, latest: AttemptRef | None
    ) -> tuple[str, AttemptRef | None]:
        """Why this call gets a new attempt, after what its latest one left (or the
        attempt to reuse: reserved at the same amount and never sent)."""
        if latest is None:
            return scope.reason, None
        if latest.state == AttemptState.SETTLED and not self.options.rerun_billed:
            raise StepNotReplayable(scope.operation_key, latest.key)
        if latest.state in OPEN:
            # moved meanwhile (settled by beat, say): never resent on a stale read
            if not self._adopt_all([latest]) or self.options.on_unknown != "resend":
                raise OutcomeUnknown(scope.operation_key, latest.key)
            return "unknown_resend", None
        if latest.state == AttemptState.RESERVED:
            return scope.reason, self._reuse_or_release(latest, where.amount)
        return "redelivery", None  # billed, with rerun_billed: a new attempt of this call

    def _reserve_call(self, scope: AttemptScope, where: _Position, key: str, reason: str) -> None:
        reservation = self._reserve_attempt(
            scope.budget,
            key,
            where.amount,
            fingerprint=scope.fingerprint,
            reason=reason,
            price_version=where.price_version,
            operation_id=scope.operation_id,
            label=where.label,
            step=where.base,
        )
        if not reservation.created:
            raise IdempotencyConflict(key, "attempt", reservation.state, "a new attempt")


class _Replayed(Exception):
    """Internal: the operation turned out finished while this delivery decided."""

    def __init__(self, result: Any) -> None:
        super().__init__("replayed")
        self.result = result
