"""BudgetTask: a Celery task base class that reserves before it runs, replays on
redelivery, and settles what the run reports.

The worker calls ``__call__`` (Celery uses a task class's own ``__call__``), which
drives the operation state machine of :mod:`budget_tasks.delivery`; it calls
``self.run``. Nothing that moves money depends on ``on_failure``/``after_return``: with
acks_late, a killed child never runs them. Celery's side (retries, eager mode) is here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Task, current_task
from celery.exceptions import Retry
from celery.signals import after_setup_logger, after_setup_task_logger, celeryd_after_setup

from . import _validate as check
from . import bypass, wiring
from ._redact import redact_handlers
from .config import ledger_of
from .delivery.fates import replayable
from .delivery.flow import Delivery, OperationManager, RetryLater
from .delivery.options import DeliveryOptions
from .delivery.scope import AttemptScope, current_scope, running, running_scopes
from .delivery.spend import SpendBlock
from .errors import (
    BudgetExceeded,
    BudgetFrozen,
    OperationFailed,
    OutcomeUnknown,
    RateWindowFull,
    SideEffectUncertain,
    raised_by_transport,
)
from .ledger import CallFacts, Ledger
from .providers.rate_headers import retry_after_of

#: Options given to ``@app.task(...)`` that are plain functions of the task's arguments.
_FUNCTION_OPTIONS = ("estimate_cost", "idempotency_key", "fingerprint", "budget", "describe_call")
#: Celery's ``retry(max_retries=None)`` means "the task's default" (3), not "no limit":
#: the retries that wait for the ledger, a lease, a rate limit or budget pass this.
NO_RETRY_LIMIT = sys.maxsize
#: The longest countdown a call waiting its turn in a rate window is handed (seconds):
#: half an hour, well inside the Redis visibility timeout the start-up check asks for.
RATE_COUNTDOWN_MOST = 1800.0


def canonical_fingerprint(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A stable hash of the task name and arguments: what defines the intent."""
    body = json.dumps(
        [name, list(args), kwargs], sort_keys=True, separators=(",", ":"), default=repr
    )
    return hashlib.sha256(body.encode()).hexdigest()


class BudgetTask(Task):  # type: ignore[misc]
    """Base class for Celery tasks that make billable LLM calls.

    Options (decorator keywords or class attributes): ``budget`` (a name, or a function
    of the task's arguments), ``estimate_cost(*args, **kwargs) -> int`` (required),
    ``idempotency_key(*args, **kwargs)`` (default: the task id), ``fingerprint``
    (default: a hash of the arguments), ``on_unknown`` ("hold" or "resend"),
    ``max_deliveries`` (runs before a message counts as poison), ``lease_seconds``
    (longer than the longest run), ``retry_when_budget_frees`` (seconds to wait and
    retry instead of failing on BudgetExceeded, for ``spend()`` too; 0 = fail),
    ``rerun_billed`` (let an automatic retry run an operation again although calls it
    paid for would be sent again; default False: it ends failed), ``describe_call``
    (the main call's :class:`~budget_tasks.ledger.CallFacts`, known before ``run``).
    """

    acks_late = True
    reject_on_worker_lost = True
    #: Outcomes of normal operation, not faults: Celery logs them as one INFO line
    #: ("raised expected") with no traceback. A denial, a frozen budget, a call whose
    #: outcome is still unknown, a replay of an operation that failed before.
    throws: ClassVar[tuple[type[BaseException], ...]] = (
        BudgetExceeded,
        BudgetFrozen,
        OutcomeUnknown,
        OperationFailed,
    )

    budget: ClassVar[Any] = None
    on_unknown: ClassVar[str] = "hold"
    max_deliveries: ClassVar[int] = 5
    lease_seconds: ClassVar[float] = 600.0
    retry_when_budget_frees: ClassVar[float] = 0.0
    rerun_billed: ClassVar[bool] = False
    #: The run's ledger writes wait for its calls (two commits per run): with
    #: ``estimate_cost`` 0, a first delivery takes its lease with its first call's
    #: admission, so its code before that call may run in two deliveries of the key at
    #: once; each call's settlement waits for the next call's admission or the run's
    #: end, so a crash in between leaves that hold to reconciliation. False: the lease
    #: is taken before ``run`` and each call settles as it returns (more commits).
    defer_writes: ClassVar[bool] = True
    #: What the main call is (a :class:`~budget_tasks.ledger.CallFacts`: lookup, model,
    #: client timeout), a function of the task's arguments, where known before ``run``:
    #: written with the admission, so the call costs two ledger commits, not three.
    describe_call: ClassVar[Any] = None
    in_progress_countdown: ClassVar[float] = 5.0
    rate_limit_countdown: ClassVar[float] = 10.0
    #: how long a run's first call may wait in the worker process for its turn in its
    #: rate windows' line (seconds of wall time, its turn read again as the windows
    #: change); a turn further off brings the message back then, and no wait spends
    #: a retry of the task's ``max_retries``
    rate_wait_in_process: ClassVar[float] = 30.0
    ledger_unavailable_countdown: ClassVar[float] = 5.0
    price_version: ClassVar[str | None] = None
    idempotency_key: ClassVar[Any] = None
    fingerprint: ClassVar[Any] = None

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
        scope = current_scope()
        if scope is None:
            raise RuntimeError("self.attempt exists only while a BudgetTask runs")
        return scope

    def _operation_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if self.idempotency_key is not None:
            return check.key(
                self.idempotency_key(*args, **kwargs),
                "idempotency key",
                max_length=check.MAX_OPERATION_KEY_LENGTH,
            )
        return str(self.request.id or uuid.uuid4())

    def _fingerprint(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if self.fingerprint is not None:
            return check.text(self.fingerprint(*args, **kwargs), "fingerprint")
        return canonical_fingerprint(self.name, args, kwargs)

    def _describe_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallFacts | None:
        if self.describe_call is None:
            return None
        facts = self.describe_call(*args, **kwargs)
        if facts is not None and not isinstance(facts, CallFacts):
            raise TypeError(f"{self.name}: describe_call must return a CallFacts or None")
        return facts

    def _budget(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        budget = self.budget(*args, **kwargs) if callable(self.budget) else self.budget
        if budget is None:
            raise ValueError(f"{self.name}: no budget (set budget=... on the task)")
        return check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)

    # -- the flow ----------------------------------------------------------------------

    def _options(self) -> DeliveryOptions:
        return DeliveryOptions(
            task=self.name,
            on_unknown=self.on_unknown,
            max_deliveries=self.max_deliveries,
            lease_seconds=self.lease_seconds,
            retry_when_budget_frees=self.retry_when_budget_frees,
            rerun_billed=self.rerun_billed,
            price_version=self.price_version,
            defer_writes=self.defer_writes,
            rate_wait_in_process=_seconds(self.rate_wait_in_process, "rate_wait_in_process"),
            retry_types=(Retry,),
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        delivery = Delivery(
            key=self._operation_key(args, kwargs),
            fingerprint=self._fingerprint(args, kwargs),
            budget=self._budget(args, kwargs),
            estimate=lambda: self.estimate_cost(*args, **kwargs),
            run=lambda scope: self._run_in(scope, args, kwargs),
            payload={"args": list(args), "kwargs": kwargs},
            describe=lambda: self._describe_call(args, kwargs),
            redelivered=bool((self.request.delivery_info or {}).get("redelivered")),
        )
        try:
            return OperationManager(self.ledger.calls, self._options()).deliver(delivery)
        except RetryLater as later:
            raise self._later(later.cause, self._countdown(later)) from later.cause

    def _countdown(self, later: RetryLater) -> float:
        """How long the message waits before it comes back (seconds)."""
        cause = later.cause
        if isinstance(cause, RateWindowFull):
            # its turn as the windows stood when it stopped waiting; a turn further
            # off comes back sooner, reads its turn and goes back again: a countdown
            # past the broker's visibility timeout would be delivered twice
            return min(cause.wait, RATE_COUNTDOWN_MOST)
        if later.why == "rate_limited":
            # the provider's retry-after, where its 429 says (never shorter than asked)
            # (at least a second: a retry-after of 0 would send it again at once)
            after = retry_after_of(cause)
            return self.rate_limit_countdown if after is None else max(after, 1.0)
        return {
            "ledger": self.ledger_unavailable_countdown,
            "in_progress": self.in_progress_countdown,
            "budget": self.retry_when_budget_frees,
        }[later.why]

    def _run_in(self, scope: AttemptScope, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bypass.install(_whose)
        with running(scope):
            try:
                return self.run(*args, **kwargs)
            except Exception as exc:
                # An SDK may wrap what the guarded transport raised (Anthropic's turns any
                # error into a connection error): the task raises ours, typed.
                ours = raised_by_transport(exc)
                if ours is None or ours is exc:
                    raise
                raise ours from exc

    def _later(self, exc: BaseException, countdown: float) -> BaseException:
        """A retry of the same message later (same task id), with no retry limit;
        eager mode just raises."""
        if self.request.called_directly or self.request.is_eager:
            return exc
        # Celery keeps a retry's max_retries on the task object, shared by every later
        # request in this process, and autoretry_for reads it: the library's own retries
        # must not lift the user's max_retries for good.
        # Nor may they count against it: the message comes back with the retry count it
        # had, so a user's autoretry_for still sends a refused request 1 + max_retries
        # times.
        had = "override_max_retries" in self.__dict__
        before = self.__dict__.get("override_max_retries")
        self.request.retries -= 1  # Celery's retry adds it back
        try:
            return self.retry(exc=exc, countdown=countdown, max_retries=NO_RETRY_LIMIT)  # type: ignore[no-any-return]
        finally:
            self.request.retries += 1
            if had:
                self.override_max_retries = before
            else:
                self.__dict__.pop("override_max_retries", None)

    # -- several calls, and side effects -------------------------------------------------

    def spend(self, amount: int, label: str) -> SpendBlock:
        """Reserve and settle one labelled billable call of this task as its own attempt:
        ``with self.spend(...) as call:``, or ``async with`` in async code (its
        admission then runs off the event loop).

        Replay-safe per label and sequence: on a redelivery, a call that completed before
        yields ``call.replayed = True`` and ``call.result``; do not call the provider
        again then. ``call.key`` grants the send; a block that never asks for it is
        released, not charged. A call whose earlier attempt was released (a 429, a
        refusal) is sent again as a new attempt with its own hold.
        """
        scope = self.attempt
        manager = scope.manager
        assert manager is not None
        return SpendBlock(lambda: manager.step(scope, amount, label))

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
                return replayable(f"{scope.operation_key}:{record}", stored[1])
            raise SideEffectUncertain(scope.operation_key, name)
        try:
            value = fn(*args, **kwargs)
        except BaseException:
            ledger.forget_side_effect(scope.operation_id, record)
            raise
        ledger.finish_side_effect(scope.operation_id, record, value)
        return value


def _whose() -> str | None:
    """Whether the calling context belongs to a BudgetTask's run, for the audit hook of
    :mod:`budget_tasks.bypass`: "mine" (its context runs one), "maybe" (a thread that
    runs no task while a run is in progress here: one the run started), or None."""
    if current_scope() is not None:
        return "mine"
    if running_scopes() and current_task._get_current_object() is None:
        return "maybe"
    return None


def _check_wiring(sender: Any = None, instance: Any = None, **_: Any) -> None:
    wiring.warn_at_start(instance, BudgetTask)


def _redact_logs(sender: Any = None, logger: logging.Logger | None = None, **_: Any) -> None:
    if logger is not None:
        redact_handlers(logger)


# A worker that loads any BudgetTask checks its wiring at start, configure() or not.
celeryd_after_setup.connect(_check_wiring, weak=False)
# Its logs (and beat's) never show a credential: an HTTP library's error may quote the
# header it refused, the key in it; Celery logs a failed task's whole traceback.
after_setup_logger.connect(_redact_logs, weak=False)
after_setup_task_logger.connect(_redact_logs, weak=False)


def _seconds(value: Any, name: str) -> float:
    """A task option that is a number of seconds (finite, not negative)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not (0 <= value < math.inf):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value}")
    return float(value)
