"""One delivery of an operation, as a state machine on the ledger (no Celery here).

:class:`OperationManager` runs the flow that ``BudgetTask.__call__`` drives: look the
operation up, replay or wait or stop, open its main call (call 0), run, then settle and
store. The main call and every labelled call are opened by one path
(:mod:`.calls`); every write is compare-and-set in the ledger, and when one finds
another state, the manager re-reads and acts on what is there.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from .. import _validate as check
from ..errors import (
    BudgetExceeded,
    BudgetFrozen,
    BudgetTasksError,
    InvalidTransition,
    LedgerUnavailable,
    OperationFailed,
    OperationInProgress,
    OutcomeUnknown,
    PoisonMessage,
    RateWindowFull,
    StepNotReplayable,
)
from ..hooks import Hooks, hooks
from ..ledger import CallFacts, CallLedger
from ..ledger.calls import FirstCall
from ..ledger.leases import owner_id
from ..ledger.operations import Decision, OperationStart, RunEnd
from ..ledger.records import PURGED_ERROR, AttemptRef, CallAdmission, CallAsk, CallEnd, SettledCall
from ..ledger.states import OperationStatus
from .calls import AnswerFound, CallPath, CallSite, GrantUnanswered, Moved, Opened, Unresolved
from .fates import (
    ErrorKind,
    HoldFate,
    before_send,
    describe_error,
    error_kind,
    fate_after_error,
    fate_after_return,
    replayable,
)
from .keys import main_key, step_key
from .options import DeliveryOptions
from .owed import (
    Write,
    call_end,
    call_write,
    catch_up,
    end_call_write,
    end_write,
    owe,
    persist,
    unsent_write,
)
from .scope import AttemptScope, Call
from .told import Told

log = logging.getLogger("budget_tasks.delivery")

#: How many times a delivery (or a labelled call) re-reads after losing a
#: compare-and-set before it gives up for now.
MAX_REREADS = 3


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
    (``why``: ledger, in_progress, rate_limited, rate_window, budget). ``cause`` is what to raise
    where there is no later (eager mode)."""

    def __init__(self, why: str, cause: BaseException) -> None:
        super().__init__(why, cause)
        self.why = why
        self.cause = cause


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


class _Replayed(Exception):
    """Internal: the operation turned out finished while this delivery decided."""

    def __init__(self, result: Any) -> None:
        super().__init__("replayed")
        self.result = result


class _Stopped(BaseException):
    """Internal: a run whose admission was deferred to its first call found, at that
    admission, that it may not go on (``cause``: a replay, another run's lease, a
    failed or poisoned operation, the ledger down). Raised through the run's own code
    (not an Exception, which that code, or an SDK, may catch and wrap), and kept on
    its scope should that code swallow it."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class OperationManager:
    """Runs deliveries of one task's operations on one ledger (see the module)."""

    def __init__(self, ledger: CallLedger, options: DeliveryOptions, sink: Hooks = hooks) -> None:
        self.ledger = ledger
        self.options = options
        self.told = Told(sink, options.task)
        self.calls = CallPath(ledger, options, self.told)

    # -- one delivery ------------------------------------------------------------------

    def deliver(self, d: Delivery) -> Any:
        """Run one delivery to its end: the result (run or replayed), or an exception:
        RetryLater, or the error the operation ended with. The hooks hear it start,
        what it decided, and how it ended."""
        token = self.told.started(d.key, d.budget)
        try:
            result = self._deliver(d)
        except RetryLater as later:
            self.told.finished(token, "retry_later", later)
            raise
        except BaseException as exc:
            self.told.finished(token, "error", exc)
            raise
        self.told.finished(token, "ok")
        return result

    def _deliver(self, d: Delivery) -> Any:
        # A redelivered message may be one whose task code killed its worker before the
        # admission committed (estimate_cost itself): its lease is taken, and the run
        # counted, before any of that code runs again, so poison detection sees it.
        estimate, facts, failure = (None, None, None) if d.redelivered else self._estimate(d)
        if estimate == 0 and self.options.defer_writes:
            return self._run(d, self._deferred_scope(d, facts))
        try:
            site, start, opened = self._start(d, estimate, facts, failure)
        except _Replayed as replayed:
            return replayable(d.key, replayed.result)
        assert site is not None and start.call is not None and opened is not None
        return self._run(d, self._scope(d, site, start.call, opened))

    def _start(
        self,
        d: Delivery,
        estimate: int | None,
        facts: CallFacts | None,
        failure: Exception | None,
        first: FirstCall | None = None,
    ) -> tuple[CallSite | None, OperationStart, Opened | None]:
        """Admit the run and open its main call: where it sits, what the admission
        found (``start.first``: ``first``'s admission, where it was made with the
        run's) and what was opened (both None: the run was admitted with ``first`` and
        no main attempt). Raises _Replayed, or what stops the run."""
        for round_ in range(MAX_REREADS):
            start = self._admit(d, estimate, facts, first if round_ == 0 else None)
            self._decided(d, start)
            if start.decision is Decision.REPLAY:
                raise _Replayed(start.result)
            if start.call is None and start.first is not None:
                assert estimate == 0  # a main call that reserves nothing needs no attempt
                self.told.decided(d.key, "admitted", None, 0)
                return None, start, None
            if estimate is None and failure is None:
                estimate, facts, failure = self._estimate(d)
            if failure is not None:
                self._end_quietly(
                    d,
                    start.operation_id,
                    OperationStatus.PENDING,
                    "estimate_cost or describe_call failed",
                )
                raise failure
            assert estimate is not None and start.call is not None
            site = self._main_site(d, self._main_ask(d, estimate, facts), start.call)
            opened = self._open_main(d, site, start.call)
            if opened is not None:
                self.told.decided(d.key, "admitted", opened.key, site.ask.amount)
                return site, start, opened
        raise RetryLater("in_progress", OperationInProgress(d.key))

    # -- a lease deferred to the run's first call ---------------------------------------

    def _deferred_scope(self, d: Delivery, facts: CallFacts | None) -> AttemptScope:
        """The scope of a first delivery whose main call reserves nothing: its run is
        admitted with its first call's admission (one commit before that call is
        sent), or when it asks for its operation, or at its end. Meanwhile another
        delivery of the key may run the same code (see docs/design.md)."""
        scope = AttemptScope(
            main_key(d.key, 1),
            0,
            self.ledger,
            reason="first",
            operation_key=d.key,
            operation_id=0,
            budget=d.budget,
            fingerprint=d.fingerprint,
            manager=self,
            owner=d.owner,
            told=self.told,
        )

        def admission(first: FirstCall | None = None) -> CallAdmission | None:
            return self._admit_deferred(d, scope, facts, first)

        scope.defer(admission)
        return scope

    def _admit_deferred(
        self, d: Delivery, scope: AttemptScope, facts: CallFacts | None, first: FirstCall | None
    ) -> CallAdmission | None:
        """Admit a deferred run (with ``first``, its first call, in the same commit):
        ``first``'s admission where it was made so. A refusal is raised into the run
        as its call's; anything else that stops the run raises _Stopped."""
        if scope.stopped is not None:
            raise _Stopped(scope.stopped)
        try:
            site, start, opened = self._start(d, 0, facts, None, first)
        except (BudgetExceeded, BudgetFrozen) as exc:
            scope.refused_unadmitted = exc  # recorded pending with the refusal
            raise
        except RateWindowFull:
            raise  # its call waits its turn (see _open_call); the run is not admitted
        except Exception as exc:
            scope.stopped = exc
            raise _Stopped(exc) from None
        if opened is None:
            scope.admitted_as(None, start.operation_id, reason="first", next_reason=None)
        else:
            assert site is not None and start.call is not None
            scope.admitted_as(
                opened.key,
                start.operation_id,
                reason=opened.reason,
                next_reason=start.call.next_reason,
                described=site.ask.facts if opened.described else None,
            )
        return start.first

    def _admitted(self, scope: AttemptScope) -> BaseException | None:
        """Admit a deferred run that reached its end without a call; what stops it."""
        if scope.stopped is None and not scope.admitted:
            with suppress(_Stopped):
                scope.operation_id  # noqa: B018 - asking admits
        return scope.stopped

    @staticmethod
    def _stopped(d: Delivery, cause: BaseException) -> Any:
        """What a stopped run returns (a replay) or raises."""
        if isinstance(cause, _Replayed):
            return replayable(d.key, cause.result)
        if isinstance(cause, RateWindowFull):
            # its first call was booked ahead before the run was admitted: nothing of
            # it was written; the message comes back when the booking is due
            raise RetryLater("rate_window", cause) from cause
        raise cause

    def _decided(self, d: Delivery, start: OperationStart) -> None:
        """What the admission decided without running: a replay (told), or raised."""
        if start.decision is Decision.REPLAY:
            log.info("operation %s replayed: no provider call, no charge", d.key)
            self.told.replayed(d.key)
        elif start.decision is Decision.FAILED:
            self.told.decided(d.key, "failed")
            raise OperationFailed(d.key, start.error or PURGED_ERROR)
        elif start.decision is Decision.POISONED:
            log.error("operation %s stopped as a poison message: %s", d.key, start.error)
            self.told.decided(d.key, "poisoned")
            raise PoisonMessage(d.key, start.error)
        elif start.decision is Decision.IN_PROGRESS:
            self.told.decided(d.key, "in_progress")
            raise RetryLater("in_progress", OperationInProgress(d.key))

    @staticmethod
    def _estimate(d: Delivery) -> tuple[int | None, CallFacts | None, Exception | None]:
        """The task's estimate and call description, or what they raised: raised once
        the delivery turns out to run (a replay needs neither)."""
        try:
            return check.money(d.estimate(), "estimate_cost"), d.describe(), None
        except Exception as exc:
            return None, None, exc

    def _main_ask(self, d: Delivery, estimate: int, facts: CallFacts | None) -> CallAsk:
        return CallAsk(
            d.budget, estimate, d.fingerprint, self.options.price_version, facts or CallFacts()
        )

    @staticmethod
    def _main_site(d: Delivery, ask: CallAsk, here: CallAdmission) -> CallSite:
        """The main call as call 0 of its operation."""
        return CallSite(
            d.key, ask, 0, run_reason=here.next_reason or "first", next_reason=here.next_reason
        )

    def _admit(
        self,
        d: Delivery,
        estimate: int | None,
        facts: CallFacts | None,
        first: FirstCall | None = None,
    ) -> OperationStart:
        ask = None if estimate is None else self._main_ask(d, estimate, facts)
        catch_up(self.ledger)
        granted: list[str] = []  # what ``first``'s plan granted, should the answer be lost
        if first is not None:
            first_ask, record, first_plan = first

            def recorded(here: CallAdmission) -> tuple[str, str] | None:
                made = first_plan(here)
                granted[:] = [] if made is None else [made[0]]
                return made

            first = (first_ask, record, recorded)

        def admission(plan: Callable[[CallAdmission], tuple[str, str] | None]) -> OperationStart:
            start: OperationStart = self.ledger.admit(
                d.key,
                fingerprint=d.fingerprint,
                owner=d.owner,
                lease=timedelta(seconds=self.options.lease_seconds),
                max_runs=self.options.max_deliveries,
                task=self.options.task,
                payload=d.payload,
                call=ask,
                plan=plan,
                first=first,
            )
            return start

        def site_of(here: CallAdmission) -> CallSite:
            assert ask is not None  # asked only where the main call is admitted
            return self._main_site(d, ask, here)

        try:
            # with ``first``, a refusal is told by that call's own admission
            # a first call admitted with the run waits for its rate windows outside
            # the run's admission (its own caller waits): a call of the run made
            # meanwhile may admit the run with itself
            return self.calls.admit(
                estimate or 0,
                site_of,
                admission,
                tell=first is None,
                patience=None if first is None else 0.0,
            )
        except (BudgetExceeded, BudgetFrozen) as exc:
            # Refused in the admission's transaction: the operation is pending again.
            if self.options.retry_when_budget_frees and first is None:
                raise RetryLater("budget", exc) from exc
            raise
        except RateWindowFull as exc:
            # nothing was admitted (the transaction rolled back): booked, it comes back
            if first is not None:
                raise
            raise RetryLater("rate_window", exc) from exc
        except GrantUnanswered as lost:
            # Fail closed: nothing is sent. The lease and a grant may have committed all
            # the same (a COMMIT whose answer was lost): this process, which knows it sent
            # nothing, gives them back once the ledger answers.
            self._give_back(d, lost, granted)
            raise RetryLater("ledger", lost.cause) from lost.cause

    def _give_back(self, d: Delivery, lost: GrantUnanswered, also: Sequence[str] = ()) -> None:
        """Owe what undoes an admission or a grant whose answer was lost: the grants (if
        they may have committed), then the lease (by the operation's id where known).
        Each write is compare-and-set on this run's lease: should the lease have moved
        on meanwhile, another run may be sending under that very attempt."""
        writes: list[Write] = []
        operation = d.key if lost.operation_id is None else lost.operation_id
        for key in (lost.key, *also):
            if key is not None:
                writes.append(unsent_write(key, operation, d.owner))
        writes.append(end_write(operation, d.owner, OperationStatus.PENDING, str(lost.cause)))
        owe(self.ledger, d.key, d.owner, writes)

    def _open_main(self, d: Delivery, site: CallSite, here: CallAdmission) -> Opened | None:
        """Open the main call as any call is opened (see :mod:`.calls`), ending the run
        on what stops it before ``run``. None: the state moved under us; read again."""
        operation = here.operation_id
        try:
            opened = self.calls.open(site, here)
        except Moved:
            self._end(operation, d.owner, None)
            return None
        except Unresolved as unresolved:
            self._concluded(d, operation, unresolved.attempt)
            return None
        except GrantUnanswered as lost:
            self._give_back(d, lost)
            raise RetryLater("ledger", lost.cause) from lost.cause
        except (BudgetExceeded, BudgetFrozen) as exc:
            # Refused before anything of this run was sent: why it runs next (an
            # operator's reopen, a 429's retry) is still why its next run runs.
            self._end_quietly(d, operation, OperationStatus.PENDING, str(exc), site.next_reason)
            if self.options.retry_when_budget_frees:
                raise RetryLater("budget", exc) from exc
            raise
        except LedgerUnavailable as exc:
            # Nothing was sent: fail closed now, and let the message come back later.
            self._end_quietly(d, operation, OperationStatus.PENDING, str(exc), site.next_reason)
            raise RetryLater("ledger", exc) from exc
        except RateWindowFull as exc:
            # booked ahead: the run ends before anything was sent, and comes back then
            self._end_quietly(d, operation, OperationStatus.PENDING, str(exc), site.next_reason)
            raise RetryLater("rate_window", exc) from exc
        except StepNotReplayable as exc:
            self._end_quietly(d, operation, OperationStatus.FAILED, describe_error(exc))
            raise
        except (BudgetTasksError, ValueError, TypeError) as exc:
            self._end_quietly(d, operation, OperationStatus.PENDING, str(exc))
            raise
        if isinstance(opened, AnswerFound):
            self._concluded(d, operation, None)
            return None
        return opened

    def _concluded(self, d: Delivery, operation: int, unresolved: AttemptRef | None) -> None:
        """An earlier attempt decides the operation (one unresolved, or an answer found):
        give the lease back and see what it became. Replayed (raised), still unknown
        (OutcomeUnknown), or None: read again."""
        end = self._end(operation, d.owner, None)
        if end.status == OperationStatus.SUCCEEDED:
            self.told.replayed(d.key)
            raise _Replayed(end.result)
        if unresolved is not None and (end.status == OperationStatus.UNKNOWN or not end.applied):
            raise OutcomeUnknown(d.key, unresolved.key)
        return None  # resolved meanwhile: read again

    def _scope(
        self, d: Delivery, site: CallSite, here: CallAdmission, opened: Opened
    ) -> AttemptScope:
        return AttemptScope(
            opened.key,
            site.ask.amount,
            self.ledger,
            reason=opened.reason,
            operation_key=d.key,
            operation_id=here.operation_id,
            budget=d.budget,
            fingerprint=d.fingerprint,
            manager=self,
            owner=d.owner,
            described=site.ask.facts if opened.described else None,
            next_reason=here.next_reason,
            told=self.told,
        )

    def _run(self, d: Delivery, scope: AttemptScope) -> Any:
        try:
            result = d.run(scope)
        except BaseException as exc:
            return self._after_error(d, scope, exc)
        if scope.stopped is not None:  # the run's code swallowed what stopped it
            return self._stopped(d, scope.stopped)
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
        stopped = self._admitted(scope)
        if stopped is not None:
            return self._stopped(d, stopped)
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
            "call": call_end(scope, fate) if scope.has_main else None,
            "owner": d.owner,
            "settled": scope.take_settled(),
        }
        operation = scope.operation_id
        try:
            end = persist(self.ledger.finish_operation, operation, **kwargs)
        except LedgerUnavailable as exc:
            kept = Write("finish_operation", {"operation_id": operation, **kwargs})
            owe(self.ledger, d.key, d.owner, [kept])
            raise RetryLater("ledger", exc) from exc
        if scope.has_main:
            self.told.ended(d.budget, scope.attempt_key, scope.amount, fate)
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
        if scope.stopped is None and not scope.admitted:
            refused = scope.refused_unadmitted
            if refused is not None and isinstance(exc, BudgetExceeded | BudgetFrozen):
                # its first call was refused, and the refusal recorded: no run was admitted
                if self.options.retry_when_budget_frees:
                    raise RetryLater("budget", exc) from exc
                raise exc
        stopped = self._admitted(scope)
        if stopped is not None:
            return self._stopped(d, stopped)
        # A task that retries itself (self.retry, autoretry_for) leaves run with Celery's
        # Retry, raised while it handled the provider's error: that error says what the
        # call cost (a 429 was not billed), and the retry is already on its way.
        retried = isinstance(exc, self.options.retry_types)
        cause = exc.__context__ if retried and exc.__context__ is not None else exc
        fate = fate or fate_after_error(scope, cause)
        after = self._run_end(scope, cause, fate, retried)
        catch_up(self.ledger)  # what this run's labelled calls still owe goes first
        end = self._write_all(d, self._end_writes(d, scope, fate, after, describe_error(exc)))
        if scope.has_main:
            self.told.ended(d.budget, scope.attempt_key, scope.amount, fate)
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
        if isinstance(cause, RateWindowFull) and rerun_safe:
            # a call was booked ahead by its rate windows: the run comes back when due
            return _RunEnd(OperationStatus.PENDING, later=None if retried else "rate_window")
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
        operation = scope.operation_id
        settled = [
            end_call_write(
                one.call,
                operation_id=operation,
                owner=d.owner,
                record=one.record,
                result=one.result,
            )
            for one in scope.take_settled()
        ]
        lease = {"owner": d.owner, "error": error}
        main = call_end(scope, fate) if scope.has_main else None
        if after.status == OperationStatus.FAILED:
            failing = {"operation_id": operation, **lease, "call": main}
            return [*settled, Write("fail_operation", failing)]
        if main is not None:
            settled.append(call_write(scope, fate, operation_id=operation, owner=d.owner))
        ending = {"operation": operation, **lease, "status": after.status}
        return [*settled, Write("end_run", {**ending, "next_reason": after.next_reason})]

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

    def _end(
        self,
        operation: int | str,
        owner: str,
        status: str | None,
        error: str | None = None,
        next_reason: str | None = None,
    ) -> RunEnd:
        end: RunEnd = self.ledger.end_run(
            operation, owner=owner, status=status, error=error, next_reason=next_reason
        )
        return end

    def _end_quietly(
        self,
        d: Delivery,
        operation: int,
        status: str,
        error: str,
        next_reason: str | None = None,
    ) -> None:
        """Give the lease back (keeping ``next_reason``, why the operation runs next);
        if the ledger is down, this process does at its next delivery (the lease names
        a live process: waiting for its expiry would hold the message off for a whole
        lease)."""
        try:
            self._end(operation, d.owner, status, error, next_reason)
        except LedgerUnavailable:
            log.warning("operation %s: could not record %s yet (ledger down)", d.key, status)
            ending = end_write(operation, d.owner, status, error, next_reason)
            owe(self.ledger, d.key, d.owner, [ending])

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
        check.key(label, "label", max_length=60)
        check.money(amount)
        facts = call or CallFacts()
        seq = scope.position(label, facts.request)
        step = step_key(scope.operation_key, label, seq)
        if len(step) + check.STEP_SUFFIX_ROOM > check.MAX_KEY_LENGTH:
            # refused before anything is reserved: the key could never be written
            raise ValueError(
                f"step {label!r} of operation {scope.operation_key[:40]!r}...: its attempt "
                f"keys would pass {check.MAX_KEY_LENGTH} characters; use a shorter label "
                "or idempotency key"
            )
        version = price_version or self.options.price_version
        ask = CallAsk(scope.budget, amount, scope.fingerprint, version, facts, label, step)
        site = CallSite(
            scope.operation_key, ask, seq, run_reason=scope.reason, next_reason=scope.next_reason
        )
        made = self._open_call(scope, site)
        if made.replayed:
            yield made
            return
        try:
            yield made
        except BaseException as exc:
            self._call_failed(scope, site, made, exc)
            raise
        fate = fate_after_return(made)
        if fate.action == "settle" and site.record is not None and self.options.defer_writes:
            # written with the run's next commit: the next call's admission, or its end
            scope.keep(SettledCall(call_end(made, fate), site.record, made.result))
        else:
            self._write_call(scope, made, fate, wait=True, record=site.record, result=made.result)
        if fate.action == "settle" or fate.untrusted:
            self.told.ended(scope.budget, made.attempt_key, made.amount, fate)

    def _open_call(self, scope: AttemptScope, site: CallSite) -> Call:
        """Open a labelled call as any call is opened (see :mod:`.calls`): replayed, or
        granted its send; what stops it is raised into the run, marked as raised before
        anything was sent."""
        ask, record = site.ask, site.record
        assert record is not None

        def admission(plan: Callable[[CallAdmission], tuple[str, str] | None]) -> CallAdmission:
            if not scope.admitted:
                first: CallAdmission | None = scope.admit_first((ask, record, plan))
                if first is not None:
                    return first
            settled = scope.take_settled()
            try:
                here: CallAdmission = self.ledger.admit_call(
                    scope.operation_id, ask, record=record, plan=plan, settled=settled
                )
            except BaseException:
                scope.put_back(settled)
                raise
            return here

        def site_of(_: CallAdmission) -> CallSite:
            # why the run exists is known once it is admitted (a deferred admission may
            # happen in this very call's)
            return replace(site, run_reason=scope.reason, next_reason=scope.next_reason)

        # A call inside a run already admitted waits for its rate windows in the
        # process, up to half the lease: its run holds the lease, its earlier calls may
        # have billed, and an error raised into its code would reach the SDK (which
        # wraps it) and the task's own retries. A run's first call, admitted with the
        # run, comes back as a message instead when the wait is long.
        patience = self._patience() if scope.admitted else None
        for _ in range(MAX_REREADS):
            try:
                here = self.calls.admit(ask.amount, site_of, admission, patience=patience)
                if here.stored is not None:
                    return Call(
                        site.key(0),
                        ask.amount,
                        str(ask.label),
                        replayed=True,
                        result=replayable(site.key(0), here.stored[1]),
                    )
                opened = self.calls.open(site_of(here), here, patience)
            except Moved:
                continue
            except RateWindowFull as full:
                if scope.admitted:
                    raise
                # the run's first call waited past its patience before the run was
                # admitted: nothing of it was written, and its message comes back
                # when the call's turn comes
                scope.stopped = full
                raise _Stopped(full) from None
            except Unresolved as unresolved:
                raise OutcomeUnknown(scope.operation_key, unresolved.attempt.key) from None
            except GrantUnanswered as lost:
                if lost.key is not None and lost.operation_id is not None:
                    undo = unsent_write(lost.key, lost.operation_id, scope.owner)
                    owe(self.ledger, scope.operation_key, scope.owner, [undo])
                raise before_send(lost.cause) from None
            except LedgerUnavailable as exc:
                raise before_send(exc) from None
            if isinstance(opened, AnswerFound):
                return self._found_call(scope, site, opened.attempt)
            described = ask.facts if opened.described else None
            return Call(
                opened.key,
                ask.amount,
                str(ask.label),
                self.ledger,
                described=described,
                told=self.told,
                budget=scope.budget,
            )
        raise OutcomeUnknown(scope.operation_key, site.key(0))

    def _patience(self) -> float:
        """How long a call inside an admitted run waits in the process for its rate
        windows: the task's ``rate_wait_in_process``, or half its lease if longer."""
        return max(self.options.rate_wait_in_process, self.options.lease_seconds / 2)

    def _call_failed(
        self, scope: AttemptScope, site: CallSite, made: Call, exc: BaseException
    ) -> None:
        """Write what an error inside a labelled call's block means for its hold."""
        fate = fate_after_error(made, exc)
        if fate.action == "settle":
            scope.billed_unstored = True
        elif fate.action == "unknown":
            scope.left_open = True
        self._write_call(scope, made, fate, wait=False)
        self.told.ended(scope.budget, made.attempt_key, made.amount, fate)
        if fate.action == "release":
            scope.refused(made.label, site.ask.facts.request)

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

    def _found_call(self, scope: AttemptScope, site: CallSite, latest: AttemptRef) -> Call:
        """Reconciliation found this call's answer: that is what it replays."""
        answer = replayable(latest.key, json.loads(latest.answer or "null"))
        self.ledger.end_call(
            CallEnd(latest.key, "store"),
            operation_id=scope.operation_id,
            owner=scope.owner,
            record=site.record,
            result=answer,
        )
        return Call(
            latest.key,
            site.ask.amount,
            str(site.ask.label),
            replayed=True,
            result=answer,
            reconciled=True,
        )
