"""BudgetTask: a Celery task base class that reserves before it runs, replays on
redelivery, and settles what the run reports.

The worker calls ``__call__`` (Celery uses a task class's own ``__call__``), which runs
the operation flow of DESIGN.md and calls ``self.run``. Nothing that moves money depends
on ``on_failure``/``after_return``: with acks_late, a killed child never runs them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

from celery import Task

from . import _validate as check
from . import metrics
from .errors import (
    BudgetExceeded,
    BudgetFrozen,
    BudgetTasksError,
    LedgerUnavailable,
    NotBilled,
    OperationFailed,
    OperationInProgress,
    OutcomeUnknown,
    PoisonMessage,
    SideEffectUncertain,
)
from .ledger import Ledger
from .ledger.operations import Decision, OperationStart, owner_id
from .providers.calls import Sent
from .providers.outcomes import ErrorOutcome, classify

log = logging.getLogger("budget_tasks.task")

LEDGER_URL_SETTING = "budget_ledger_url"
LEDGER_URL_ENV = "BUDGET_TASKS_LEDGER_URL"
#: Options given to ``@app.task(...)`` that are plain functions of the task's arguments.
_FUNCTION_OPTIONS = ("estimate_cost", "idempotency_key", "fingerprint", "budget")

#: Pauses between tries of a settlement that must land after a provider call.
PERSIST_DELAYS = (0.5, 1.0, 2.0, 4.0)
#: Celery's ``retry(max_retries=None)`` means "the task's default" (3), not "no limit":
#: the retries that wait for the ledger, a lease, a rate limit or budget pass this.
NO_RETRY_LIMIT = sys.maxsize

_ledgers: dict[str, Ledger] = {}
_ledgers_lock = threading.Lock()


def ledger_for(url: str) -> Ledger:
    """One Ledger per URL per process (its connections survive fork safely)."""
    with _ledgers_lock:
        ledger = _ledgers.get(url)
        if ledger is None:
            ledger = Ledger(url)
            if url.startswith("sqlite"):
                ledger.create_schema()  # the embedded default needs no migration step
            _ledgers[url] = ledger
        return ledger


def ledger_of(app: Any) -> Ledger:
    """The ledger a Celery app is configured with (``budget_ledger_url``, else env
    ``BUDGET_TASKS_LEDGER_URL``); none configured means nothing may be sent."""
    url = app.conf.get(LEDGER_URL_SETTING) or os.environ.get(LEDGER_URL_ENV)
    if not url:
        raise LedgerUnavailable(
            f"no ledger configured: set {LEDGER_URL_SETTING} (env {LEDGER_URL_ENV})"
        )
    return ledger_for(str(url))


def _persist(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a ledger write that must land, waiting out a short outage."""
    for delay in PERSIST_DELAYS:
        try:
            return fn(*args, **kwargs)
        except LedgerUnavailable:
            log.warning("ledger unavailable; retrying %s in %.1fs", fn.__name__, delay)
            time.sleep(delay)
    return fn(*args, **kwargs)


@dataclass(frozen=True)
class _Unwritten:
    """What a delivery could not write because the ledger was down: giving its lease
    back (``status`` pending/failed), or its whole outcome after the provider answered
    (``status`` succeeded, with the result and the settlements)."""

    owner: str
    status: str
    error: str | None = None
    result: Any = None
    settlements: tuple[tuple[str, int, bool], ...] = ()

    def write(self, ledger: Ledger, key: str) -> None:
        if self.status == "succeeded":
            ledger.finish_operation(key, result=self.result, settlements=self.settlements)
        else:
            ledger.end_operation(key, self.status, error=self.error, owner=self.owner)


#: (ledger URL, operation key, lease owner) -> what this process still has to write. The
#: lease names this process, which is alive: no other delivery may run the operation
#: until the lease expires, so this process writes it at its next delivery instead.
_unwritten: dict[tuple[str, str, str], _Unwritten] = {}
_unwritten_lock = threading.Lock()


def _ledger_id(ledger: Ledger) -> str:
    return ledger.engine.url.render_as_string(hide_password=False)


def _keep_unwritten(ledger: Ledger, key: str, entry: _Unwritten) -> None:
    with _unwritten_lock:
        _unwritten[(_ledger_id(ledger), key, entry.owner)] = entry


def catch_up(ledger: Ledger) -> int:
    """Write what this process kept while the ledger was down (leases to give back,
    outcomes of calls that were answered); returns how many were written. Stops at the
    first LedgerUnavailable and keeps the rest for the next delivery."""
    if not _unwritten:
        return 0
    ledger_id = _ledger_id(ledger)
    with _unwritten_lock:
        pending = [(k, v) for k, v in _unwritten.items() if k[0] == ledger_id]
    written = 0
    for slot, entry in pending:
        try:
            entry.write(ledger, slot[1])
        except LedgerUnavailable:
            return written
        except BudgetTasksError as exc:  # e.g. settled since by an operator: theirs stands
            log.error("operation %s: dropped what the outage kept back: %s", slot[1], exc)
        else:
            written += 1
            log.info("operation %s: wrote what the outage kept back (%s)", slot[1], entry.status)
        with _unwritten_lock:
            if _unwritten.get(slot) is entry:
                del _unwritten[slot]
    return written


def close_ledgers() -> None:
    """Close and forget this process's ledgers (tests that rebuild the database)."""
    with _ledgers_lock:
        ledgers = list(_ledgers.values())
        _ledgers.clear()
    for ledger in ledgers:
        ledger.dispose()


def canonical_fingerprint(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A stable hash of the task name and arguments: what defines the intent."""
    body = json.dumps(
        [name, list(args), kwargs], sort_keys=True, separators=(",", ":"), default=repr
    )
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass(kw_only=True)
class _Recorded:
    """One billable attempt as the code inside a task sees it: its key (the provider's
    Idempotency-Key), what it reserved, and where its usage and ids are recorded."""

    key: str
    amount: int
    actual: int | None = None
    request_id: str | None = None
    _ledger: Ledger | None = None

    def record_usage(self, cost: int) -> None:
        """The actual cost of the call, in minor units (sums over several reports)."""
        check.money(cost, "cost")
        self.actual = (self.actual or 0) + cost

    def record_request_id(self, request_id: str) -> None:
        """Store the provider's request id at once (reconciliation looks it up)."""
        if self._ledger is not None and request_id != self.request_id:
            self._ledger.record_request_id(self.key, request_id)
        self.request_id = request_id

    def describe(self, lookup: str, model: str, response_id: str | None = None) -> None:
        """Record what the call is, before it is sent, for reconciliation."""
        if self._ledger is not None:
            self._ledger.describe_attempt(
                self.key, lookup=lookup, model=model, response_id=response_id
            )

    def record(self, sent: Sent) -> None:
        """Record a guarded call's request id, response id and priced usage."""
        if sent.request_id:
            self.record_request_id(sent.request_id)
        if sent.response_id and self._ledger is not None:
            self._ledger.describe_attempt(self.key, response_id=sent.response_id)
        if sent.cost is not None:
            self.record_usage(sent.cost)


@dataclass(kw_only=True)
class AttemptScope(_Recorded):
    """What ``self.attempt`` gives ``run``: the operation's main attempt."""

    reason: str
    operation_key: str
    operation_id: int
    budget: str
    fingerprint: str
    _labels: dict[str, int] = field(default_factory=dict)

    @property
    def ledger(self) -> Ledger:
        assert self._ledger is not None
        return self._ledger


@dataclass(kw_only=True)
class Call(_Recorded):
    """One labelled billable call inside a task (``with self.spend(...) as call``).

    On a redelivery, a call that completed before has ``replayed`` set and its stored
    ``result``: do not call the provider again then.
    """

    label: str
    replayed: bool = False
    result: Any = None

    def record(self, sent: Sent, result: Any = None) -> None:
        """Record the call's ids and cost, and the result to replay on redelivery."""
        super().record(sent)
        self.result = sent.result if result is None else result


class BudgetTask(Task):  # type: ignore[misc]
    """Base class for Celery tasks that make billable LLM calls.

    Options (decorator keywords or class attributes): ``budget`` (a name, or a function
    of the task's arguments), ``estimate_cost(*args, **kwargs) -> int`` (required),
    ``idempotency_key(*args, **kwargs)`` (default: the task id), ``fingerprint``
    (default: a hash of the arguments), ``on_unknown`` ("hold" or "resend"),
    ``max_deliveries`` (runs before a message counts as poison), ``lease_seconds``
    (longer than the longest run), ``retry_when_budget_frees`` (seconds to wait and
    retry instead of failing on BudgetExceeded; 0 = fail).
    """

    acks_late = True
    reject_on_worker_lost = True

    budget: ClassVar[Any] = None
    on_unknown: ClassVar[str] = "hold"
    max_deliveries: ClassVar[int] = 5
    lease_seconds: ClassVar[float] = 600.0
    retry_when_budget_frees: ClassVar[float] = 0.0
    in_progress_countdown: ClassVar[float] = 5.0
    rate_limit_countdown: ClassVar[float] = 10.0
    ledger_unavailable_countdown: ClassVar[float] = 5.0
    price_version: ClassVar[str | None] = None
    idempotency_key: ClassVar[Any] = None
    fingerprint: ClassVar[Any] = None

    _scope = threading.local()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("_decorated"):
            # @app.task(...) puts option functions in the class body: they take the
            # task's arguments, not self.
            for name in _FUNCTION_OPTIONS:
                value = cls.__dict__.get(name)
                if callable(value) and not isinstance(value, staticmethod | type):
                    setattr(cls, name, staticmethod(value))

    # -- configuration ---------------------------------------------------------------

    def estimate_cost(self, *args: Any, **kwargs: Any) -> int:
        """An upper bound on what ``run`` will spend, in minor units. Required."""
        raise NotImplementedError(
            f"{self.name}: set estimate_cost (a function of the task's arguments returning "
            "an int of minor units), e.g. with budget_tasks.providers.estimates"
        )

    @property
    def ledger(self) -> Ledger:
        return ledger_of(self.app)

    @property
    def attempt(self) -> AttemptScope:
        """The current attempt, inside ``run``."""
        scope: AttemptScope | None = getattr(self._scope, "current", None)
        if scope is None:
            raise RuntimeError("self.attempt exists only while a BudgetTask runs")
        return scope

    def _operation_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if self.idempotency_key is not None:
            return check.text(self.idempotency_key(*args, **kwargs), "idempotency key")
        return str(self.request.id or uuid.uuid4())

    def _fingerprint(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if self.fingerprint is not None:
            return check.text(self.fingerprint(*args, **kwargs), "fingerprint")
        return canonical_fingerprint(self.name, args, kwargs)

    def _budget(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        budget = self.budget(*args, **kwargs) if callable(self.budget) else self.budget
        if budget is None:
            raise ValueError(f"{self.name}: no budget (set budget=... on the task)")
        return check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)

    # -- the flow ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self._operation_key(args, kwargs)
        fingerprint = self._fingerprint(args, kwargs)
        budget = self._budget(args, kwargs)
        ledger = self.ledger
        owner = owner_id()
        try:
            catch_up(ledger)
            start = ledger.begin_operation(
                key,
                fingerprint=fingerprint,
                owner=owner,
                lease=timedelta(seconds=self.lease_seconds),
                max_runs=self.max_deliveries,
                task=self.name,
                payload={"args": list(args), "kwargs": kwargs},
            )
        except LedgerUnavailable as exc:
            # Fail closed: no reservation, no send. The message comes back later. The
            # lease may have been taken all the same (a COMMIT whose answer was lost):
            # give it back once the ledger answers.
            _keep_unwritten(ledger, key, _Unwritten(owner, "pending", str(exc)))
            raise self._later(exc, self.ledger_unavailable_countdown) from exc
        if start.decision is Decision.REPLAY:
            log.info("operation %s replayed: no provider call, no charge", key)
            metrics.REPLAYS.labels(self.name).inc()
            return start.result
        if start.decision is Decision.FAILED:
            raise OperationFailed(key, start.error)
        if start.decision is Decision.POISONED:
            log.error("operation %s stopped as a poison message: %s", key, start.error)
            raise PoisonMessage(key, start.error)
        if start.decision is Decision.IN_PROGRESS:
            raise self._later(OperationInProgress(key), self.in_progress_countdown)
        return self._run_operation(ledger, start, owner, budget, fingerprint, args, kwargs)

    def _later(self, exc: BaseException, countdown: float) -> BaseException:
        """A retry of the same message later (same task id), with no retry limit;
        eager mode just raises."""
        if self.request.called_directly or self.request.is_eager:
            return exc
        return self.retry(exc=exc, countdown=countdown, max_retries=NO_RETRY_LIMIT)  # type: ignore[no-any-return]

    def _run_operation(
        self,
        ledger: Ledger,
        start: OperationStart,
        owner: str,
        budget: str,
        fingerprint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        try:
            scope = self._reserve(ledger, start, owner, budget, fingerprint, args, kwargs)
        except LedgerUnavailable as exc:
            # Nothing was sent: fail closed now, and let the message come back later.
            self._end_quietly(ledger, start.key, owner, "pending", str(exc))
            raise self._later(exc, self.ledger_unavailable_countdown) from exc
        self._scope.current = scope
        try:
            result = self.run(*args, **kwargs)
        except BaseException as exc:
            try:
                self._settle_error(ledger, scope, exc)
            except LedgerUnavailable as down:
                # The ledger went down with the run (run() met it too, or it failed
                # now). What the error meant is not written: the attempt stays
                # 'sending', so the next delivery finds it and keeps its hold as
                # unknown. Give the lease back (now, or once the ledger answers), and
                # bring the message back rather than lose it.
                self._end_quietly(ledger, start.key, owner, "pending", str(down))
                raise self._later(down, self.ledger_unavailable_countdown) from exc
            raise
        finally:
            self._scope.current = None
        actual = scope.actual if scope.actual is not None else scope.amount
        estimate_only = scope.actual is None
        try:
            json.dumps(result)
        except (TypeError, ValueError) as exc:
            _persist(ledger.settle, scope.key, actual, estimate_only=estimate_only)
            self._end_quietly(ledger, start.key, owner, "failed", f"result is not JSON: {exc}")
            raise
        # The provider was called: the settlement must land, so a short outage is
        # waited out. If it lasts, this process keeps the outcome and writes it at its
        # next delivery (the lease is its own meanwhile), and the message comes back
        # later to replay it; should this process die first, the attempt stays
        # 'sending' and is reconciled.
        settlements = ((scope.key, actual, estimate_only),)
        try:
            _persist(ledger.finish_operation, start.key, result=result, settlements=settlements)
        except LedgerUnavailable as exc:
            _keep_unwritten(
                ledger,
                start.key,
                _Unwritten(owner, "succeeded", result=result, settlements=settlements),
            )
            raise self._later(exc, self.ledger_unavailable_countdown) from exc
        metrics.settled(budget, scope.amount, actual)
        return result

    def _reserve(
        self,
        ledger: Ledger,
        start: OperationStart,
        owner: str,
        budget: str,
        fingerprint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AttemptScope:
        """Everything before the send: decide the attempt, reserve, mark it sending."""
        key = start.key
        last = start.last_attempt
        reason = start.next_reason or ("first" if start.attempts == 0 else "redelivery")
        reuse = None
        if last is not None and last.state in ("sending", "unknown"):
            if last.state == "sending":
                ledger.mark_unknown(last.key, "a later delivery found it sending: worker lost")
                metrics.UNKNOWN_OUTCOMES.labels(self.name).inc()
            if self.on_unknown != "resend":
                ledger.end_operation(key, "unknown", error=f"outcome of {last.key} unknown")
                raise OutcomeUnknown(key, last.key)
            reason = "unknown_resend"
        elif last is not None and last.state == "reserved":
            reuse = last  # reserved and never sent: that hold is this run's permission
        try:
            estimate = check.money(self.estimate_cost(*args, **kwargs), "estimate_cost")
        except (TypeError, ValueError, NotImplementedError):
            self._end_quietly(ledger, key, owner, "pending", "estimate failed")
            raise
        if reuse is not None and reuse.amount != estimate:
            ledger.release(reuse.key, "never sent; re-estimated on redelivery")
            reuse = None
        attempt_key = reuse.key if reuse is not None else f"{key}#{start.attempts + 1}"
        if reuse is None:
            try:
                ledger.reserve(
                    budget,
                    attempt_key,
                    estimate,
                    fingerprint=fingerprint,
                    reason=reason,
                    price_version=self.price_version,
                    operation_id=start.operation_id,
                )
            except BudgetExceeded as exc:
                metrics.DENIALS.labels(exc.budget, "exceeded").inc()
                self._end_quietly(ledger, key, owner, "pending", str(exc))
                if self.retry_when_budget_frees and not self.request.is_eager:
                    raise self.retry(
                        exc=exc, countdown=self.retry_when_budget_frees, max_retries=NO_RETRY_LIMIT
                    ) from exc
                raise
            except (BudgetTasksError, ValueError, TypeError) as exc:
                if isinstance(exc, BudgetFrozen):
                    metrics.DENIALS.labels(exc.budget, "frozen").inc()
                if not isinstance(exc, LedgerUnavailable):
                    self._end_quietly(ledger, key, owner, "pending", str(exc))
                raise
            metrics.ADMISSIONS.labels(budget).inc()
        # The reservation is committed: this is the one grant of a send.
        ledger.mark_sending(attempt_key)
        return AttemptScope(
            key=attempt_key,
            amount=estimate,
            reason=reason,
            operation_key=key,
            operation_id=start.operation_id,
            budget=budget,
            fingerprint=fingerprint,
            _ledger=ledger,
        )

    @staticmethod
    def _end_quietly(ledger: Ledger, key: str, owner: str, status: str, error: str) -> None:
        """Give the lease back; if the ledger is down, this process does at its next
        delivery (the lease names a live process: waiting for its expiry would hold
        the message off for a whole lease)."""
        try:
            ledger.end_operation(key, status, error=error, owner=owner)
        except LedgerUnavailable:
            log.warning("operation %s: could not record %s yet (ledger down)", key, status)
            _keep_unwritten(ledger, key, _Unwritten(owner, status, error))

    def _settle_error(self, ledger: Ledger, scope: AttemptScope, exc: BaseException) -> None:
        """What an error from run() means for the hold (DESIGN: the task flow)."""
        outcome = ErrorOutcome.NOT_BILLED if isinstance(exc, NotBilled) else classify(exc)
        key = scope.operation_key
        if outcome is ErrorOutcome.UNKNOWN:
            ledger.mark_unknown(scope.key, f"{type(exc).__name__}: {exc}"[:2000])
            ledger.end_operation(key, "unknown", error=f"{type(exc).__name__}: {exc}")
            metrics.UNKNOWN_OUTCOMES.labels(self.name).inc()
            return
        ledger.release(scope.key, f"not billed: {type(exc).__name__}: {exc}"[:2000])
        if outcome is ErrorOutcome.RATE_LIMITED:
            # A new attempt with its own hold, later: never a silent SDK retry.
            ledger.end_operation(key, "retryable", error=str(exc), next_reason="rate_limited_retry")
            if not (self.request.called_directly or self.request.is_eager):
                raise self.retry(
                    exc=exc, countdown=self.rate_limit_countdown, max_retries=NO_RETRY_LIMIT
                ) from exc
            return
        ledger.end_operation(key, "failed", error=f"{type(exc).__name__}: {exc}")

    # -- several calls, and side effects -------------------------------------------------

    @contextmanager
    def spend(self, amount: int, label: str) -> Iterator[Call]:
        """Reserve and settle one labelled billable call of this task as its own attempt.

        Replay-safe per label and sequence: on a redelivery, a call that completed
        before yields ``call.replayed = True`` and ``call.result``; do not call the
        provider again then.
        """
        scope = self.attempt
        check.text(label, "label", max_length=60)
        ledger = scope.ledger
        seq = scope._labels.get(label, 0) + 1
        scope._labels[label] = seq
        key = f"{scope.operation_key}:{label}:{seq}"
        record = f"spend:{label}:{seq}"
        stored = ledger.side_effect(scope.operation_id, record)
        if stored is not None and stored[0] == "done":
            yield Call(key=key, amount=amount, label=label, replayed=True, result=stored[1])
            return
        reservation = ledger.reserve(
            scope.budget,
            key,
            amount,
            fingerprint=scope.fingerprint,
            reason=scope.reason,
            price_version=self.price_version,
            operation_id=scope.operation_id,
            label=label,
        )
        if reservation.created:
            metrics.ADMISSIONS.labels(scope.budget).inc()
        if not reservation.created and reservation.state != "reserved":
            if reservation.state == "sending":
                ledger.mark_unknown(key, "a later delivery found it sending: worker lost")
            raise OutcomeUnknown(scope.operation_key, key)
        ledger.mark_sending(key)
        call = Call(key=key, amount=amount, label=label, _ledger=ledger)
        try:
            yield call
        except BaseException as exc:
            outcome = ErrorOutcome.NOT_BILLED if isinstance(exc, NotBilled) else classify(exc)
            if outcome is ErrorOutcome.UNKNOWN:
                ledger.mark_unknown(key, f"{type(exc).__name__}: {exc}"[:2000])
            else:
                ledger.release(key, f"not billed: {type(exc).__name__}: {exc}"[:2000])
            raise
        actual = call.actual if call.actual is not None else amount
        ledger.settle(key, actual, estimate_only=call.actual is None)
        metrics.settled(scope.budget, amount, actual)
        if ledger.start_side_effect(scope.operation_id, record):
            ledger.finish_side_effect(scope.operation_id, record, call.result)

    def once(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` at most once per operation; on a redelivery,
        return the result it recorded. A run that died mid-call is not repeated:
        :class:`SideEffectUncertain` says so."""
        scope = self.attempt
        ledger = scope.ledger
        record = f"once:{check.text(name, 'side effect name', max_length=200)}"
        if not ledger.start_side_effect(scope.operation_id, record):
            stored = ledger.side_effect(scope.operation_id, record)
            if stored is not None and stored[0] == "done":
                return stored[1]
            raise SideEffectUncertain(scope.operation_key, name)
        try:
            value = fn(*args, **kwargs)
        except BaseException:
            ledger.forget_side_effect(scope.operation_id, record)
            raise
        ledger.finish_side_effect(scope.operation_id, record, value)
        return value
