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

import enum
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Protocol

from . import _validate as check
from .errors import (
    BudgetExceeded,
    BudgetFrozen,
    BudgetTasksError,
    CallConflict,
    IdempotencyConflict,
    InvalidTransition,
    LedgerUnavailable,
    NotBilled,
    OperationFailed,
    OperationInProgress,
    OutcomeUnknown,
    ParallelCallsUnlabelled,
    PoisonMessage,
    PricingError,
    RetriesEnabled,
    SideEffectUncertain,
    StepNotReplayable,
    UnguardedCall,
    UnknownBudget,
    UnmeteredConnection,
)
from .hooks import Hooks, hooks
from .ledger import CallFacts, Ledger
from .ledger.operations import AttemptRef, Decision, OperationStart, RunEnd, owner_id
from .ledger.states import HOLDING, OPEN, AttemptState, OperationStatus, nothing_sent_under
from .providers.outcomes import ErrorOutcome, classify

log = logging.getLogger("budget_tasks.delivery")

_running: ContextVar[AttemptScope | None] = ContextVar("budget_tasks_run", default=None)
#: Every run in progress in this process, by the thread it runs on.
_active: dict[int, AttemptScope] = {}
_active_lock = threading.Lock()


def current_scope() -> AttemptScope | None:
    """The attempt scope of the BudgetTask run in this context (its thread, the asyncio
    tasks it starts, or a context copied from it), if one runs."""
    return _running.get()


def running_scopes() -> list[AttemptScope]:
    """Every run in progress in this process (prefork: at most one)."""
    with _active_lock:
        return list(_active.values())


@contextmanager
def running(scope: AttemptScope) -> Iterator[AttemptScope]:
    """Make ``scope`` this context's current run (a run inside another's nests)."""
    token = _running.set(scope)
    ident = threading.get_ident()
    with _active_lock:
        outer = _active.get(ident)
        _active[ident] = scope
    try:
        yield scope
    finally:
        _running.reset(token)
        with _active_lock:
            if outer is None:
                _active.pop(ident, None)
            else:
                _active[ident] = outer


#: Pauses between tries of a write that must land after a provider call.
PERSIST_DELAYS = (0.5, 1.0, 2.0, 4.0)
#: How many times a delivery re-reads after losing a compare-and-set before it gives
#: the message back for later.
MAX_REREADS = 3
#: What the result of a step replays as when its step is reconciled but none stored.
_STEP_RECORD = "spend:{label}:{seq}"


# -- what an error means ---------------------------------------------------------------


class ErrorKind(enum.Enum):
    """What an exception out of ``run`` (or a call inside it) means for a hold."""

    NOT_BILLED = "not_billed"  # the provider certainly did not bill the call
    RATE_LIMITED = "rate_limited"  # 429: not billed; a retry is a new attempt
    UNKNOWN = "unknown"  # the call may have billed
    BEFORE_SEND = "before_send"  # the library refused before any byte was sent


#: Errors budget-tasks raises before anything is sent (for the call they concern).
BEFORE_SEND_ERRORS: tuple[type[BaseException], ...] = (
    BudgetExceeded,
    BudgetFrozen,
    UnknownBudget,
    IdempotencyConflict,
    PricingError,
    OutcomeUnknown,
    SideEffectUncertain,
    StepNotReplayable,
    RetriesEnabled,
    CallConflict,
    UnguardedCall,
    UnmeteredConnection,
    ParallelCallsUnlabelled,
)


def before_send(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised before anything was sent (e.g. a LedgerUnavailable while
    reserving or granting)."""
    exc.__dict__["budget_tasks_before_send"] = True
    return exc


def error_kind(exc: BaseException) -> ErrorKind:
    if isinstance(exc, NotBilled):
        return ErrorKind.NOT_BILLED
    if isinstance(exc, BEFORE_SEND_ERRORS) or exc.__dict__.get("budget_tasks_before_send"):
        return ErrorKind.BEFORE_SEND
    return {
        ErrorOutcome.NOT_BILLED: ErrorKind.NOT_BILLED,
        ErrorOutcome.RATE_LIMITED: ErrorKind.RATE_LIMITED,
        ErrorOutcome.UNKNOWN: ErrorKind.UNKNOWN,
    }[classify(exc)]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


# -- keys ------------------------------------------------------------------------------


def _quote(label: str) -> str:
    # The separators of step keys never appear inside a label: keys stay one-to-one.
    return label.replace("%", "%25").replace(":", "%3A").replace("~", "%7E").replace("#", "%23")


def main_key(operation: str, number: int) -> str:
    """The key of an operation's ``number``-th main-call attempt: ``op#n``."""
    return f"{operation}#{number}"


def step_key(operation: str, label: str, seq: int, number: int = 1) -> str:
    """The key of attempt ``number`` of the ``seq``-th call labelled ``label``:
    ``op:label:seq`` for the first attempt, ``op:label:seq~n`` for later ones. Main keys
    end in ``#n``, first step keys in ``:n``, later ones in ``~n``, and a label never
    holds ``:``, ``~`` or ``#`` (they are %-escaped): no two positions share a key."""
    base = f"{operation}:{_quote(label)}:{seq}"
    return base if number == 1 else f"{base}~{number}"


# -- what run() sees -------------------------------------------------------------------


class _Grants(Protocol):
    def record_call(
        self,
        key: str,
        *,
        request_id: str | None = ...,
        response_id: str | None = ...,
        cost: int | None = ...,
    ) -> None: ...
    def describe_attempt(
        self,
        key: str,
        *,
        lookup: str | None = ...,
        model: str | None = ...,
        response_id: str | None = ...,
        timeout: float | None = ...,
        request: str | None = ...,
    ) -> None: ...


class Recorded:
    """One billable attempt as the code inside a task sees it.

    Reading :attr:`key` marks a call as out until it reports. What a call reports (its
    request and response ids, its usage) is kept here and written with the attempt's
    settlement, in the same commit; only a call answered without its usage (a background
    Response) has its ids written at once, since reconciliation reads it by them."""

    def __init__(
        self, key: str, amount: int, ledger: Any = None, described: CallFacts | None = None
    ) -> None:
        self._key = key
        self.amount = amount
        self.actual: int | None = None
        self.request_id: str | None = None
        self.response_id: str | None = None
        self._ledger: _Grants | None = ledger
        #: what the ledger records of the call (written with the admission)
        self._described = described
        #: someone asked for the key: a call may have been sent under it
        self.used = False
        #: a call on this attempt may be out (the key was read since its last report)
        self.in_flight = False
        #: a call answered without its usage (a background response): settled later
        self.awaiting_usage = False

    @property
    def key(self) -> str:
        """The attempt key (the provider's Idempotency-Key). Asking for it marks a call
        as out until it reports (``record``/``record_usage``)."""
        self.used = True
        self.in_flight = True
        return self._key

    @property
    def attempt_key(self) -> str:
        """The key, without granting a send (for logs)."""
        return self._key

    @property
    def provider_key(self) -> str:
        """What the provider is sent as this attempt's key (its Idempotency-Key): an
        opaque digest of the ledger's installation and the attempt key. Asking for it
        grants the send, as :attr:`key` does."""
        ledger = self._ledger
        digest = None
        if ledger is not None and hasattr(ledger, "provider_key"):
            try:
                digest = ledger.provider_key(self._key)
            except LedgerUnavailable as exc:
                raise before_send(exc) from None
        key = self.key
        return digest or key

    @property
    def ids(self) -> tuple[str | None, str | None]:
        """The request and response ids the call reported, for its settlement."""
        return self.request_id, self.response_id

    def record_usage(self, cost: int) -> None:
        """The actual cost of the call, in minor units (sums over several reports),
        settled at once when the attempt settles: a recorded actual is proof of
        billing, and whatever happens after, the hold is settled at it, never released."""
        check.money(cost, "cost")
        self.actual = (self.actual or 0) + cost
        self.in_flight = False

    def record_request_id(self, request_id: str) -> None:
        """The provider's request id, written with the attempt's settlement."""
        self.request_id = check.text(request_id, "request_id")

    def describe(
        self,
        lookup: str,
        model: str,
        response_id: str | None = None,
        timeout: float | None = None,
        request: str | None = None,
    ) -> None:
        """Record what the call is, before it is sent, for reconciliation. Where the
        admission described it so already, nothing is written."""
        facts = CallFacts(lookup, model, timeout, request)
        # Where the admission described the call (describe_call), its request digest
        # alone is not worth a commit of its own: the provider key already keeps another
        # installation's, or another attempt's, answer from being adopted.
        described = self._described
        if (
            response_id is None
            and described
            and described.covers(CallFacts(lookup, model, timeout))
        ):
            return
        if self._ledger is not None:
            try:
                self._ledger.describe_attempt(
                    self._key,
                    lookup=lookup,
                    model=model,
                    response_id=response_id,
                    timeout=timeout,
                    request=request,
                )
            except LedgerUnavailable as exc:
                raise before_send(exc) from None
        self._described = facts

    def record(self, sent: Any) -> None:
        """Keep a guarded call's request id, response id and priced usage for the
        settlement. A call answered without usage (a background response) keeps its hold
        open until reconciliation reads the usage: its ids are written at once."""
        if sent.request_id:
            self.request_id = sent.request_id
        if sent.response_id:
            self.response_id = sent.response_id
        if sent.cost is not None:
            self.actual = (self.actual or 0) + sent.cost
        else:
            self.awaiting_usage = True
        self.in_flight = False
        if sent.cost is None and self._ledger is not None:
            self._ledger.record_call(
                self._key, request_id=sent.request_id, response_id=sent.response_id
            )


class AttemptScope(Recorded):
    """What ``self.attempt`` gives ``run``: the operation's main attempt."""

    def __init__(
        self,
        key: str,
        amount: int,
        ledger: Any,
        *,
        reason: str,
        operation_key: str,
        operation_id: int,
        budget: str,
        fingerprint: str,
        manager: OperationManager | None = None,
        owner: str = "",
        described: CallFacts | None = None,
    ) -> None:
        super().__init__(key, amount, ledger, described)
        self.owner = owner
        self.reason = reason
        self.operation_key = operation_key
        self.operation_id = operation_id
        self.budget = budget
        self.fingerprint = fingerprint
        self.manager = manager
        self._labels: dict[str, int] = {}
        #: label -> the request digest of its last call, where the provider refused it
        #: unbilled: the same request sent again is that call's next attempt
        self._refused: dict[str, str] = {}
        #: a labelled call billed and not stored for replay (a new run would resend it)
        self.billed_unstored = False
        #: a labelled call of this run whose outcome is unknown (its hold kept)
        self.left_open = False

    @property
    def key(self) -> str:
        """The main attempt's key. Refused when ``estimate_cost`` was 0: nothing is
        reserved for a call under it (use ``spend()`` or the guarded transport)."""
        if self.amount == 0:
            raise ValueError(
                f"operation {self.operation_key!r}: estimate_cost is 0, so nothing was "
                "reserved for a call under the main attempt; give an estimate, or make "
                "the calls with self.spend(...) or through the guarded transport"
            )
        return super().key

    @property
    def ledger(self) -> Ledger:
        assert self.manager is not None
        ledger: Ledger = self.manager.ledger
        return ledger


class Call(Recorded):
    """One labelled billable call inside a task (``with self.spend(...) as call``).

    On a redelivery, a call that completed before has ``replayed`` set and its stored
    ``result`` (``reconciled`` too when the ledger found its answer at the provider):
    do not call the provider again then."""

    def __init__(
        self,
        key: str,
        amount: int,
        label: str,
        ledger: Any = None,
        *,
        replayed: bool = False,
        result: Any = None,
        reconciled: bool = False,
        described: CallFacts | None = None,
    ) -> None:
        super().__init__(key, amount, ledger, described)
        self.label = label
        self.replayed = replayed
        self.result = result
        self.reconciled = reconciled

    def record(self, sent: Any, result: Any = None) -> None:
        """Record the call's ids and cost, and the result to replay on redelivery."""
        super().record(sent)
        self.result = sent.result if result is None else result


# -- what an attempt's hold becomes after an error ------------------------------------


@dataclass(frozen=True)
class HoldFate:
    """What to write for one attempt's hold: release it, settle it, or keep it open."""

    action: str  # release | settle | unknown
    actual: int = 0
    estimate_only: bool = False
    note: str = ""


def fate_after_return(call: Recorded) -> HoldFate:
    """What a call's hold becomes when ``run`` returned (whatever happens next)."""
    if call.awaiting_usage and call.actual is None:
        return HoldFate("unknown", note="answered without usage: settled when it is read")
    if call.actual is None:
        return HoldFate("settle", call.amount, True, "no usage recorded")
    return HoldFate("settle", call.actual, False)


def fate_after_error(call: Recorded, exc: BaseException) -> HoldFate:
    """What an error out of ``run`` (or a ``spend`` block) means for ``call``'s hold."""
    why = _describe(exc)
    if not call.used and call.actual is None:
        return HoldFate("release", note=f"its key was never used: {why}")
    if not call.in_flight:
        # Every call on it reported: the error came after them.
        if call.awaiting_usage:
            return HoldFate("unknown", note="answered without usage: settled when it is read")
        if call.actual is None:
            return HoldFate("settle", call.amount, True, f"no usage recorded; {why}")
        return HoldFate("settle", call.actual, False, f"billed, then {why}")
    kind = error_kind(exc)
    if kind is ErrorKind.BEFORE_SEND:
        # The error is not this call's; what it was asked to send may have been billed.
        if call.actual is not None:
            return HoldFate("settle", call.actual, False, f"billed, then {why}")
        return HoldFate("settle", call.amount, True, f"its key was used, then {why}")
    if kind in (ErrorKind.NOT_BILLED, ErrorKind.RATE_LIMITED):
        if call.actual:
            return HoldFate("settle", call.actual, False, f"billed, then {why}")
        return HoldFate("release", note=f"not billed: {why}")
    return HoldFate("unknown", call.actual or 0, note=why)


# -- writes that must land -------------------------------------------------------------


@dataclass(frozen=True)
class _Write:
    """One ledger write kept back while the ledger was down."""

    name: str
    kwargs: dict[str, Any]

    def apply(self, ledger: Ledger) -> Any:
        return getattr(ledger, self.name)(**self.kwargs)


#: (ledger URL, operation key, lease owner) -> the writes this process still owes. The
#: lease names this process, which is alive: no other delivery may run the operation
#: until the lease expires, so this process writes them at its next delivery instead.
_owed: dict[tuple[str, str, str], list[_Write]] = {}
_owed_lock = threading.Lock()


#: How the log names each kind of write kept back.
_WRITTEN = {
    "finish_operation": "succeeded",
    "fail_operation": "failed",
    "end_run": "lease given back",
    "end_call": "a call's outcome",
}


def _ledger_id(ledger: Any) -> str:
    return str(ledger.engine.url.render_as_string(hide_password=False))


def _owe(ledger: Any, key: str, owner: str, writes: list[_Write]) -> None:
    with _owed_lock:
        _owed.setdefault((_ledger_id(ledger), key, owner), []).extend(writes)


def catch_up(ledger: Any) -> int:
    """Write what this process kept back while the ledger was down (holds to resolve,
    leases to give back, outcomes of calls that were answered); returns how many
    operations were written. Stops at the first LedgerUnavailable and keeps the rest."""
    if not _owed:
        return 0
    ledger_id = _ledger_id(ledger)
    with _owed_lock:
        pending = [(k, v) for k, v in _owed.items() if k[0] == ledger_id]
    written = 0
    for slot, writes in pending:
        done: list[str] = []
        while writes:
            try:
                writes[0].apply(ledger)
            except LedgerUnavailable:
                return written
            except BudgetTasksError as exc:  # moved on since (an operator): theirs stands
                log.error("operation %s: dropped %s kept back: %s", slot[1], writes[0].name, exc)
            else:
                done.append(_WRITTEN.get(writes[0].name, writes[0].name))
            writes.pop(0)
        written += 1
        log.info("operation %s: wrote what the outage kept back (%s)", slot[1], ", ".join(done))
        with _owed_lock:
            if _owed.get(slot) is writes:
                del _owed[slot]
    return written


def _persist(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a ledger write that must land, waiting out a short outage."""
    for delay in PERSIST_DELAYS:
        try:
            return fn(*args, **kwargs)
        except LedgerUnavailable:
            log.warning("ledger unavailable; retrying %s in %.1fs", fn.__name__, delay)
            time.sleep(delay)
    return fn(*args, **kwargs)


# -- the flow ----------------------------------------------------------------------------


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
            _owe(
                self.ledger,
                d.key,
                d.owner,
                [_end_write(d, OperationStatus.PENDING, str(exc), True)],
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
            for attempt in left:
                if attempt.state == AttemptState.SENDING and not self._adopt(attempt):
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
        reuse = last if (last is not None and last.state == AttemptState.RESERVED) else None
        if reuse is not None and reuse.amount != estimate:
            try:
                self.ledger.release(
                    reuse.key, "never sent; re-estimated on redelivery", expected="reserved"
                )
            except InvalidTransition:
                self._end(d, None)
                return None
            reuse = None
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
            _owe(
                self.ledger,
                d.key,
                d.owner,
                [_end_write(d, OperationStatus.PENDING, str(exc), unsent=True)],
            )
            raise RetryLater("ledger", exc) from exc
        return True

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
            reservation = self.ledger.reserve(
                d.budget,
                key,
                amount,
                fingerprint=d.fingerprint,
                reason=reason,
                price_version=self.options.price_version,
                operation_id=operation_id,
            )
        except (BudgetExceeded, BudgetFrozen) as exc:
            self._denied(exc, amount)
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
        self.hooks.admitted(budget=d.budget, attempt=key, amount=amount)
        return True

    def _run(self, d: Delivery, scope: AttemptScope) -> Any:
        try:
            result = d.run(scope)
        except BaseException as exc:
            return self._after_error(d, scope, exc)
        try:
            encoded = json.dumps(result)
        except Exception as exc:  # TypeError, ValueError, RecursionError, an encoder's own
            # The provider answered: its charge lands and the lease comes back.
            failure = TypeError(f"the result of {d.key} cannot be stored as JSON: {_describe(exc)}")
            return self._after_error(d, scope, failure, fate=fate_after_return(scope))
        return self._finish(d, scope, result, encoded)

    def _finish(self, d: Delivery, scope: AttemptScope, result: Any, encoded: str) -> Any:
        catch_up(self.ledger)  # what this run's labelled calls still owe goes first
        settlements: list[tuple[str, int, bool]] = []
        left_open: list[tuple[str, str]] = []
        if scope.awaiting_usage and scope.actual is None:
            left_open.append(
                (scope.attempt_key, "answered without usage: settled by reconciliation")
            )
        else:
            actual = scope.actual if scope.actual is not None else scope.amount
            settlements.append((scope.attempt_key, actual, scope.actual is None))
        # The provider was called: the outcome must land, so a short outage is waited
        # out. If it lasts, this process keeps it and writes it at its next delivery (the
        # lease is its own meanwhile); should this process die first, the attempt stays
        # 'sending' and is reconciled.
        kwargs = {
            "result": None,
            "encoded": encoded,
            "settlements": settlements,
            "left_open": left_open,
            "owner": d.owner,
            "attempt": scope.attempt_key,
            "ids": {scope.attempt_key: scope.ids},
        }
        try:
            end = _persist(self.ledger.finish_operation, d.key, **kwargs)
        except LedgerUnavailable as exc:
            _owe(
                self.ledger, d.key, d.owner, [_Write("finish_operation", {"key": d.key, **kwargs})]
            )
            raise RetryLater("ledger", exc) from exc
        for key, actual, _ in settlements:
            self.hooks.settled(
                budget=d.budget, attempt=key, amount=scope.amount, actual=actual, by="task"
            )
        if not end.applied:
            if end.status == OperationStatus.SUCCEEDED:
                log.warning("operation %s was finished meanwhile: its stored result stands", d.key)
                return end.result
            log.warning(
                "operation %s: this run's charge landed, its result not (now %s)", d.key, end.status
            )
        return result

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
        kind = error_kind(cause)
        billed = fate.action == "settle" or scope.billed_unstored
        rerun_safe = not billed or self.options.rerun_billed
        status: str | None
        next_reason = None
        later: str | None = None
        if fate.action == "unknown" or scope.left_open or isinstance(cause, OutcomeUnknown):
            status = None  # derived: unknown while a hold is open
        elif isinstance(cause, LedgerUnavailable):
            status, later = OperationStatus.PENDING, None if retried else "ledger"
        elif kind is ErrorKind.RATE_LIMITED and rerun_safe:
            status, next_reason, later = (
                OperationStatus.RETRYABLE,
                "rate_limited_retry",
                None if retried else "rate_limited",
            )
        elif retried and rerun_safe:
            status = OperationStatus.PENDING  # the task asked to run again later
        elif isinstance(cause, BudgetExceeded | BudgetFrozen) and rerun_safe:
            status = OperationStatus.PENDING
            later = "budget" if self.options.retry_when_budget_frees else None
        else:
            status = OperationStatus.FAILED
        error = _describe(exc)
        catch_up(self.ledger)  # what this run's labelled calls still owe goes first
        writes = [_call_write(scope, fate, operation_id=scope.operation_id, owner=d.owner)]
        if status == OperationStatus.FAILED:
            if fate.action == "settle":
                writes = [
                    _Write(
                        "fail_operation",
                        {
                            "key": d.key,
                            "owner": d.owner,
                            "error": error,
                            "settlements": [(scope.attempt_key, fate.actual, fate.estimate_only)],
                            "ids": {scope.attempt_key: scope.ids},
                        },
                    )
                ]
            else:
                writes.append(
                    _Write("fail_operation", {"key": d.key, "owner": d.owner, "error": error})
                )
        else:
            writes.append(
                _Write(
                    "end_run",
                    {
                        "key": d.key,
                        "owner": d.owner,
                        "status": status,
                        "error": error,
                        "next_reason": next_reason,
                    },
                )
            )
        end = self._write_all(d, writes)
        self._tell(d, scope, fate)
        if end is None:  # the ledger is down: the writes are owed; bring the message back
            raise RetryLater("ledger", exc) from exc
        if end.status == OperationStatus.SUCCEEDED:
            # A reconciliation found the answer meanwhile; it is the operation's result.
            return end.result
        if later is not None and end.applied:
            raise RetryLater(later, exc) from exc
        raise exc

    def _write_all(self, d: Delivery, writes: list[_Write]) -> RunEnd | None:
        end = None
        for i, write in enumerate(writes):
            try:
                end = write.apply(self.ledger)
            except LedgerUnavailable:
                _owe(self.ledger, d.key, d.owner, writes[i:])
                return None
            except InvalidTransition as exc:
                log.warning("operation %s: %s moved meanwhile: %s", d.key, write.name, exc)
        return end if isinstance(end, RunEnd) else None

    def _tell(self, d: Delivery, scope: Recorded, fate: HoldFate) -> None:
        key = scope.attempt_key
        if fate.action == "unknown":
            self.hooks.unknown(task=self.options.task, attempt=key)
        elif fate.action == "settle":
            self.hooks.settled(
                budget=d.budget, attempt=key, amount=scope.amount, actual=fate.actual, by="task"
            )
        else:
            self.hooks.released(budget=d.budget, attempt=key, amount=scope.amount, by="task")

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
            _owe(self.ledger, d.key, d.owner, [_end_write(d, status, error)])

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
        seq = scope._labels.get(label, 0)
        refused = scope._refused.pop(label, None)
        if not (seq and refused is not None and refused == facts.request):
            # A request sent again after the provider refused it (a retry in the task's
            # own code) stays at its position: a redelivery that meets the position
            # answered replays that answer, instead of sending the request once more.
            seq += 1
        scope._labels[label] = seq
        base = step_key(scope.operation_key, label, seq)
        if len(base) + check.STEP_SUFFIX_ROOM > check.MAX_KEY_LENGTH:
            # refused before anything is reserved: the key could never be written
            raise ValueError(
                f"step {label!r} of operation {scope.operation_key[:40]!r}...: its attempt "
                f"keys would pass {check.MAX_KEY_LENGTH} characters; use a shorter label "
                "or idempotency key"
            )
        record = _STEP_RECORD.format(label=label, seq=seq)
        try:
            found = self._step_attempt(
                scope,
                amount,
                label,
                base,
                record,
                facts,
                price_version or self.options.price_version,
            )
        except LedgerUnavailable as exc:
            raise before_send(exc) from None
        if isinstance(found, Call):
            yield found
            return
        key, granted = found
        ledger = self.ledger
        if not granted:
            try:
                ledger.mark_sending(key)
            except LedgerUnavailable as exc:
                raise before_send(exc) from None
        made = Call(key, amount, label, ledger, described=facts if granted else None)
        try:
            yield made
        except BaseException as exc:
            fate = fate_after_error(made, exc)
            if fate.action == "settle":
                scope.billed_unstored = True
            elif fate.action == "unknown":
                scope.left_open = True
            self._write_call(scope, made, fate, wait=False)
            self._tell_step(scope, made, fate)
            if fate.action == "release" and facts.request is not None:
                scope._refused[label] = facts.request
            raise
        fate = fate_after_return(made)
        self._write_call(scope, made, fate, wait=True, record=record, result=made.result)
        if fate.action == "settle":
            self._tell_step(scope, made, fate)

    def _write_call(
        self, scope: AttemptScope, call: Call, fate: HoldFate, *, wait: bool, **stored: Any
    ) -> None:
        """Write what a labelled call came to (with its result, where it returned). As
        for the main call: a call that returned waits out a short outage (``wait``),
        one that raised does not (its run is ending); past that, this process owes the
        write and makes it before its run's end, or at its next delivery."""
        write = _call_write(
            call, fate, operation_id=scope.operation_id, owner=scope.owner, **stored
        )
        try:
            if wait:
                _persist(getattr(self.ledger, write.name), **write.kwargs)
            else:
                write.apply(self.ledger)
        except LedgerUnavailable:
            log.warning(
                "operation %s: call %s kept back (ledger down)",
                scope.operation_key,
                call.attempt_key,
            )
            _owe(self.ledger, scope.operation_key, scope.owner, [write])

    def _step_attempt(
        self,
        scope: AttemptScope,
        amount: int,
        label: str,
        base: str,
        record: str,
        facts: CallFacts,
        price_version: str | None = None,
    ) -> Call | tuple[str, bool]:
        """A replayed call, or the key of the attempt this call sends under and whether
        it was granted with its admission."""
        ledger = self.ledger

        def plan(latest: AttemptRef | None, count: int) -> tuple[str, str] | None:
            # a new attempt at once where nothing earlier is left to decide
            if latest is None:
                return base, scope.reason
            if latest.state == AttemptState.RELEASED:
                return f"{base}~{count + 1}", "redelivery"
            return None

        try:
            admission = ledger.admit_step(
                scope.operation_id,
                base,
                record,
                budget=scope.budget,
                amount=amount,
                fingerprint=scope.fingerprint,
                label=label,
                plan=plan,
                price_version=price_version,
                call=facts,
            )
        except (BudgetExceeded, BudgetFrozen) as exc:
            self._denied(exc, amount)
            raise
        if admission.stored is not None:
            return Call(base, amount, label, replayed=True, result=admission.stored[1])
        if admission.reservation is not None:
            if not admission.reservation.created:
                raise IdempotencyConflict(
                    admission.reservation.key,
                    "attempt",
                    admission.reservation.state,
                    "a new attempt",
                )
            self.hooks.admitted(
                budget=scope.budget, attempt=admission.reservation.key, amount=amount
            )
            return admission.reservation.key, True
        latest, count = admission.latest, admission.count
        reason = scope.reason
        reuse = None
        if latest is not None:
            if latest.state == AttemptState.SETTLED and latest.answer is not None:
                # Reconciliation found its answer: that is what it replays.
                answer = json.loads(latest.answer)
                ledger.end_call(
                    latest.key,
                    operation_id=scope.operation_id,
                    owner=scope.owner,
                    action="store",
                    record=record,
                    result=answer,
                )
                return Call(
                    latest.key, amount, label, replayed=True, result=answer, reconciled=True
                )
            if latest.state == AttemptState.SETTLED and not self.options.rerun_billed:
                raise StepNotReplayable(scope.operation_key, latest.key)
            if latest.state in OPEN:
                if latest.state == AttemptState.SENDING:
                    self._adopt(latest)
                if self.options.on_unknown != "resend":
                    raise OutcomeUnknown(scope.operation_key, latest.key)
                reason = "unknown_resend"
            elif latest.state == AttemptState.RESERVED:
                if latest.amount == amount:
                    reuse = latest
                else:
                    ledger.release(latest.key, "never sent; re-estimated", expected="reserved")
            else:  # billed, with rerun_billed: a new attempt of this call
                reason = "redelivery"
        key = reuse.key if reuse is not None else (base if count == 0 else f"{base}~{count + 1}")
        if reuse is None:
            try:
                reservation = ledger.reserve(
                    scope.budget,
                    key,
                    amount,
                    fingerprint=scope.fingerprint,
                    reason=reason,
                    price_version=price_version,
                    operation_id=scope.operation_id,
                    label=label,
                    step=base,
                )
            except (BudgetExceeded, BudgetFrozen) as exc:
                self._denied(exc, amount)
                raise
            if not reservation.created:
                raise IdempotencyConflict(key, "attempt", reservation.state, "a new attempt")
            self.hooks.admitted(budget=scope.budget, attempt=key, amount=amount)
        return key, False

    def _tell_step(self, scope: AttemptScope, call: Call, fate: HoldFate) -> None:
        if fate.action == "unknown":
            self.hooks.unknown(task=self.options.task, attempt=call.attempt_key)
        elif fate.action == "settle":
            self.hooks.settled(
                budget=scope.budget,
                attempt=call.attempt_key,
                amount=call.amount,
                actual=fate.actual,
                by="task",
            )
        else:
            self.hooks.released(
                budget=scope.budget, attempt=call.attempt_key, amount=call.amount, by="task"
            )


class _Replayed(Exception):
    """Internal: the operation turned out finished while this delivery decided."""

    def __init__(self, result: Any) -> None:
        super().__init__("replayed")
        self.result = result


def _call_write(
    call: Recorded,
    fate: HoldFate,
    *,
    operation_id: int,
    owner: str,
    record: str | None = None,
    result: Any = None,
) -> _Write:
    """The one write of what a call came to (the main call or a labelled one), made
    under ``owner``'s lease: kept through an outage, it still knows which run made it."""
    kwargs: dict[str, Any] = {
        "key": call.attempt_key,
        "operation_id": operation_id,
        "owner": owner,
        "action": fate.action,
        "actual": fate.actual,
        "estimate_only": fate.estimate_only,
        "note": fate.note or None,
        "ids": call.ids,
    }
    if record is not None:
        kwargs.update(record=record, result=result)
    return _Write("end_call", kwargs)


def _end_write(d: Delivery, status: str, error: str, unsent: bool = False) -> _Write:
    kwargs = {"key": d.key, "owner": d.owner, "status": status, "error": error}
    return _Write("end_run", {**kwargs, "unsent": True} if unsent else kwargs)
