"""Typed errors raised by budget-tasks.

Every error carries the facts a caller needs to act on it as attributes. Its ``args``
are its constructor's arguments, so it survives pickling and Celery's JSON result
backend (which rebuilds an exception as ``cls(*args)``) with its type and facts.
"""

from __future__ import annotations

from typing import Any


class BudgetTasksError(Exception):
    """Base class of every error budget-tasks raises on purpose."""

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        self.facts = facts
        for name, value in facts.items():
            setattr(self, name, value)
        if facts:
            # The facts, in the constructor's order, are what rebuilds the error.
            self.args = tuple(facts.values())

    def __str__(self) -> str:
        return self.message


class LedgerError(BudgetTasksError):
    """A ledger operation was refused; nothing was written."""


class LedgerUnavailable(LedgerError):
    """The ledger database could not be reached or failed mid-transaction.

    Fail closed: without a committed reservation there is no permission to send.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(f"ledger unavailable, nothing may be sent: {detail}", detail=detail)


class SchemaMissing(LedgerUnavailable):
    """The ledger database lacks a ledger table: never migrated, or at an older revision.
    Run ``budget-tasks db upgrade``.

    A LedgerUnavailable, so whatever fails closed on an unreachable ledger fails closed
    here too: nothing may be sent, and a retry succeeds once the schema is there.
    """

    def __init__(self, detail: str) -> None:
        LedgerError.__init__(
            self,
            f"the ledger schema is missing or out of date ({detail}): "
            "run `budget-tasks db upgrade`",
            detail=detail,
        )


class LedgerConfigError(BudgetTasksError, ValueError):
    """The ledger URL is wrong: it does not parse, names a database other than
    PostgreSQL or SQLite, or a driver that is not installed. Nothing was connected to.

    A ValueError too, as this error was before it had a type of its own.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid ledger URL: {reason}", reason=reason)


class UnknownBudget(LedgerError):
    """No budget has this name."""

    budget: str

    def __init__(self, budget: str) -> None:
        super().__init__(f"unknown budget {budget!r}", budget=budget)


class BudgetExists(LedgerError):
    """A budget with this name already exists."""

    budget: str

    def __init__(self, budget: str) -> None:
        super().__init__(f"budget {budget!r} already exists", budget=budget)


class BudgetExceeded(LedgerError):
    """Admitting the amount would take a budget (or an ancestor) past its cap."""

    budget: str
    requested: int
    available: int

    def __init__(self, budget: str, requested: int, available: int) -> None:
        super().__init__(
            f"budget {budget!r} cannot admit {requested}: {available} available",
            budget=budget,
            requested=requested,
            available=available,
        )


class BudgetFrozen(LedgerError):
    """The budget (or an ancestor) is frozen and admits nothing."""

    budget: str

    def __init__(self, budget: str) -> None:
        super().__init__(f"budget {budget!r} is frozen", budget=budget)


class CapBelowCommitted(LedgerError):
    """A cap may not go below what its current period has already spent and holds:
    that money is committed. Freeze the budget to stop new admissions instead."""

    budget: str
    requested: int
    committed: int

    def __init__(self, budget: str, requested: int, committed: int) -> None:
        super().__init__(
            f"budget {budget!r}: its current period has spent and holds {committed}, so its "
            f"cap cannot be {requested}; freeze it to stop new admissions",
            budget=budget,
            requested=requested,
            committed=committed,
        )


class IdempotencyConflict(LedgerError):
    """The key is already used for a different request (HTTP would say 422)."""

    key: str
    field: str

    def __init__(self, key: str, field: str, recorded: Any, requested: Any) -> None:
        super().__init__(
            f"key {key!r} was used with {field}={recorded!r}, not {requested!r}",
            key=key,
            field=field,
            recorded=recorded,
            requested=requested,
        )


class UnknownAttempt(LedgerError):
    """No attempt has this key."""

    key: str

    def __init__(self, key: str) -> None:
        super().__init__(f"unknown attempt {key!r}", key=key)


class SettlementConflict(LedgerError):
    """The attempt is already settled or released with another actual amount."""

    key: str
    recorded: int
    requested: int

    def __init__(self, key: str, recorded: int, requested: int) -> None:
        super().__init__(
            f"attempt {key!r} already settled at {recorded}, not {requested}",
            key=key,
            recorded=recorded,
            requested=requested,
        )


class UsageRecorded(LedgerError):
    """The attempt's run recorded usage, which is proof of billing: it cannot be
    released, nor settled below that usage."""

    key: str
    recorded: int
    requested: int

    def __init__(self, key: str, recorded: int, requested: int) -> None:
        super().__init__(
            f"attempt {key!r} recorded usage of {recorded}, so it was billed: it cannot be "
            f"{'released' if requested == 0 else f'settled at {requested}'}; settle it at "
            f"{recorded} or more",
            key=key,
            recorded=recorded,
            requested=requested,
        )


class InvalidTransition(LedgerError):
    """The attempt's state does not allow this step (e.g. a second mark_sending)."""

    key: str
    state: str
    action: str

    def __init__(self, key: str, state: str, action: str) -> None:
        super().__init__(
            f"attempt {key!r} is {state}: cannot {action}", key=key, state=state, action=action
        )


class PricingError(BudgetTasksError):
    """A cost could not be computed or bounded; nothing was reserved."""


class UnknownModelPrice(PricingError):
    """The price table has no entry for this model (a price is never guessed)."""

    model: str
    version: str

    def __init__(self, model: str, version: str) -> None:
        super().__init__(
            f"no price for model {model!r} in price table {version}; add it or give an "
            "explicit estimate",
            model=model,
            version=version,
        )


class EstimateRefused(PricingError):
    """The request has no upper bound to estimate from (e.g. no max output tokens)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, reason=reason)


class RefusedEndpoint(EstimateRefused):
    """A request that may bill and that nothing bounds (a batch from an uploaded file, a
    realtime session, a POST no vendor knows): refused before it is sent."""

    def __init__(self, method: str, path: str, why: str, name: str = "") -> None:
        allow = (
            f"; let it through unmetered with allow=({name!r},) and reserve for it yourself"
            f" (BudgetTask.spend)"
            if name
            else ""
        )
        PricingError.__init__(
            self,
            f"{method} {path} is not metered and is refused before sending: {why}{allow}",
            method=method,
            path=path,
            reason=why,
            name=name,
        )


class ProviderError(BudgetTasksError):
    """A provider call was refused or its outcome could not be read."""


class RetriesEnabled(ProviderError):
    """An SDK client with automatic retries: every retry that may bill must be a new,
    reserved attempt, so budget-tasks only accepts clients with ``max_retries=0``."""

    def __init__(self, client: str, max_retries: object) -> None:
        super().__init__(
            f"{client} has max_retries={max_retries!r}; budget-tasks needs max_retries=0 "
            "(use budget_tasks.providers.openai_client()/anthropic_client() or "
            "client.with_options(max_retries=0))",
            client=client,
            max_retries=max_retries,
        )


class SdkRetryRefused(RetriesEnabled):
    """The SDK sent a billable request again on its own (its ``x-stainless-retry-count``
    header says so): refused before it left. The first try keeps its hold; a retry that
    may bill is a new, reserved attempt, never the SDK's."""

    def __init__(self, path: str, retry: str) -> None:
        ProviderError.__init__(
            self,
            f"the SDK retried POST {path} on its own (x-stainless-retry-count={retry}); "
            "refused before sending: build the client with max_retries=0 "
            "(budget_tasks.transport.guarded_openai_client()/guarded_anthropic_client())",
            path=path,
            retry=retry,
        )


class UsageUnreadable(ProviderError):
    """An answer's usage that is not a count (a string of letters, a negative or an
    endless number, a usage that is no object): nothing is charged from it. The call's
    outcome is unknown and its hold kept, for reconciliation or an operator."""

    def __init__(self, field: str, value: object) -> None:
        super().__init__(
            f"the answer's usage {field} is {value!r}, not a count of tokens: its "
            "outcome is unknown and its hold kept",
            field=field,
            value=repr(value)[:80],
        )


class StreamIncomplete(ProviderError):
    """A stream ended before the provider said it was complete: the outcome is unknown."""

    def __init__(self, provider: str, detail: str) -> None:
        super().__init__(
            f"{provider} stream ended early ({detail}); outcome unknown",
            provider=provider,
            detail=detail,
        )


class UnknownOperation(LedgerError):
    """No operation has this idempotency key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"unknown operation {key!r}", key=key)


class OutcomeUnknown(BudgetTasksError):
    """An earlier attempt of this operation may have billed and its outcome is unknown:
    under ``on_unknown="hold"`` nothing is resent; reconciliation decides."""

    def __init__(self, key: str, attempt: str) -> None:
        super().__init__(
            f"operation {key!r}: the outcome of attempt {attempt!r} is unknown; its hold is "
            "kept and nothing is resent until reconciliation or an operator resolves it",
            key=key,
            attempt=attempt,
        )


class ResendRefused(BudgetTasksError):
    """A call is out under this attempt with no outcome reported (a timeout, a reset
    after sending): sending again under it could bill twice for one hold. Nothing is
    sent; the attempt keeps its hold. Let the error end the run: its hold stays as
    unknown, and a retry is a new attempt."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"attempt {key!r} has a call out whose outcome is unknown: nothing more is "
            "sent under it; let the error end the run (its retry is a new attempt)",
            key=key,
        )


class OperationInProgress(BudgetTasksError):
    """Another worker holds a live lease on this operation: retry later, no new charge."""

    def __init__(self, key: str) -> None:
        super().__init__(f"operation {key!r} is running elsewhere", key=key)


class OperationFailed(BudgetTasksError):
    """The operation failed for good before; a redelivery reports that failure again."""

    def __init__(self, key: str, error: str | None) -> None:
        super().__init__(f"operation {key!r} failed before: {error}", key=key, error=error)


class PoisonMessage(BudgetTasksError):
    """The message's runs kept dying (a killed worker each time): it is stopped."""

    def __init__(self, key: str, error: str | None) -> None:
        super().__init__(str(error or f"poison message {key!r}"), key=key, error=error)


class SideEffectUncertain(BudgetTasksError):
    """A once() side effect started and never recorded its end: it is not run again."""

    def __init__(self, key: str, name: str) -> None:
        super().__init__(
            f"side effect {name!r} of operation {key!r} started but its outcome was never "
            "recorded; it is not run twice",
            key=key,
            name=name,
        )


class StepNotReplayable(BudgetTasksError):
    """A labelled call of this operation was billed and its result was not stored (its
    run failed after the call): running it again would send it again, so it is not
    (a task with ``rerun_billed=True`` allows it)."""

    def __init__(self, key: str, attempt: str) -> None:
        super().__init__(
            f"operation {key!r}: call {attempt!r} was billed and its result is not stored; "
            "it is not sent again (rerun_billed=True allows it)",
            key=key,
            attempt=attempt,
        )


class NotBilled(Exception):
    """Raise from a task's ``run`` when the provider certainly did not bill: the hold is
    released instead of kept."""


class UnguardedCall(BudgetTasksError):
    """A billable request through the guarded transport outside a BudgetTask's run:
    refused before sending, so nothing bypasses the ledger by accident."""

    def __init__(self, method: str, path: str) -> None:
        super().__init__(
            f"{method} {path} is billable and no BudgetTask runs on this thread: nothing was "
            "sent (make the call inside run(), or build the client with allow_unguarded=True)",
            method=method,
            path=path,
        )


class ParallelCallsUnlabelled(BudgetTasksError):
    """Two threads or asyncio tasks made calls at one label path in one run: the order
    of their positions would depend on scheduling. Refused before anything is sent."""

    def __init__(self, path: str) -> None:
        super().__init__(
            f"calls at {path!r} come from two threads or tasks of one run at once: their "
            "positions would depend on which runs first, so a redelivery could hand one "
            "branch the other's stored answer. Nothing was sent. Wrap each branch's calls in "
            "budget_tasks.transport.call_label(<a name of its own>)",
            path=path,
        )


class UnmeteredConnection(BudgetTasksError):
    """A connection to a provider endpoint opened inside a BudgetTask's ``run`` by a
    client that is not guarded: refused before any byte was sent."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            f"a connection to the provider at {host}:{port} was opened inside a BudgetTask's "
            "run by a client that is not guarded: refused, nothing was sent. Use "
            "budget_tasks.transport.guarded_openai_client()/guarded_anthropic_client() (or "
            "their async twins, or http_client=guarded_http_client()); wrap an unbilled "
            "call in budget_tasks.bypass.unmetered() to let it through on purpose",
            host=host,
            port=port,
        )


class CallConflict(BudgetTasksError):
    """On a redelivery, the call at a position of the run sends another request body than
    the one stored there: the run is not deterministic up to that point."""

    def __init__(self, key: str, attempt: str) -> None:
        super().__init__(
            f"operation {key!r}: call {attempt!r} now sends another request than the one it "
            "sent before; a redelivery replays calls by position, so the run must make the "
            "same calls in the same order (or use another idempotency key)",
            key=key,
            attempt=attempt,
        )


def mark_raised_by_transport(exc: BudgetTasksError) -> BudgetTasksError:
    """Mark an error of ours raised inside the guarded transport: an SDK that wraps it
    (as a connection error) does not hide it from the task (see
    :func:`raised_by_transport`)."""
    exc.__dict__["budget_tasks_transport"] = True
    return exc


def raised_by_transport(exc: BaseException) -> BudgetTasksError | None:
    """The error the guarded transport raised under ``exc`` (an SDK's wrapper), if any."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, BudgetTasksError) and current.__dict__.get("budget_tasks_transport"):
            return current
        if isinstance(current, BaseExceptionGroup):  # raised inside an async task group
            todo.extend(current.exceptions)
        todo.extend(e for e in (current.__cause__ or current.__context__,) if e is not None)
    return None
