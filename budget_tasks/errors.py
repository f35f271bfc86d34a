"""Typed errors raised by budget-tasks.

Each error is declared once, by its facts and its message: the facts are its fields
(typed attributes and its constructor's arguments, in order) and its message a
template of them. Its ``args`` are those facts, so it survives pickling and Celery's
JSON result backend (which rebuilds an exception as ``cls(*args)``) with its type and
facts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, dataclass_transform


@dataclass_transform(eq_default=False)
class BudgetTasksError(Exception):
    """Base class of every error budget-tasks raises on purpose."""

    #: the message, formatted with the error's facts (``str.format`` fields)
    template: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Exceptions compare and hash by identity, and keep Exception's repr.
        dataclasses.dataclass(eq=False, repr=False)(cls)

    def __post_init__(self) -> None:
        self.args = tuple(self.facts.values())

    @property
    def facts(self) -> dict[str, Any]:
        """The error's facts by name, in its constructor's order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @property
    def message(self) -> str:
        return self.template.format(**self.facts)

    def __str__(self) -> str:
        return self.message


class LedgerError(BudgetTasksError):
    """A ledger operation was refused; nothing was written."""


class LedgerUnavailable(LedgerError):
    """The ledger database could not be reached or failed mid-transaction.

    Fail closed: without a committed reservation there is no permission to send.
    """

    template = "ledger unavailable: {detail}"
    detail: str


class SchemaMissing(LedgerUnavailable):
    """The ledger database lacks a ledger table: never migrated, or at an older revision.
    Run ``budget-tasks db upgrade``.

    A LedgerUnavailable, so whatever fails closed on an unreachable ledger fails closed
    here too: nothing may be sent, and a retry succeeds once the schema is there.
    """

    template = (
        "the ledger schema is missing or out of date ({detail}): run `budget-tasks db upgrade`"
    )


class LedgerConfigError(BudgetTasksError, ValueError):
    """The ledger URL is wrong: it does not parse, names a database other than
    PostgreSQL or SQLite, or a driver that is not installed. Nothing was connected to.

    A ValueError too, as this error was before it had a type of its own.
    """

    template = "invalid ledger URL: {reason}"
    reason: str


class RetentionRefused(LedgerError):
    """A retention run or view was refused (SQLite, a window too short, no archive
    directory); nothing was archived or removed."""

    template = "retention refused: {reason}"
    reason: str


class UnknownBudget(LedgerError):
    """No budget has this name."""

    template = "unknown budget {budget!r}"
    budget: str


class BudgetExists(LedgerError):
    """A budget with this name already exists."""

    template = "budget {budget!r} already exists"
    budget: str


class BudgetExceeded(LedgerError):
    """Admitting the amount would take a budget (or an ancestor) past its cap."""

    template = "budget {budget!r} cannot admit {requested}: {available} available"
    budget: str
    requested: int
    available: int


class BudgetFrozen(LedgerError):
    """The budget (or an ancestor) is frozen and admits nothing."""

    template = "budget {budget!r} is frozen"
    budget: str


class RateWindowFull(LedgerError):
    """A rate window of the call's scope has no room now: nothing was admitted, and the
    call (attempt ``key``) waits in the window's line, its turn due in ``wait_ms``
    milliseconds as the window stands now (the task waits, then sends under the same
    key without taking again; its turn moves with the window meanwhile)."""

    template = (
        "the {provider} rate limit of {scope!r} ({kind} a minute) is full: "
        "call {key!r} waits its turn, due in {wait_ms} ms"
    )
    provider: str
    scope: str
    kind: str
    wait_ms: int
    key: str | None = None

    @property
    def wait(self) -> float:
        """Seconds until the call's booking falls due."""
        return self.wait_ms / 1000


class RateAskTooLarge(LedgerError):
    """One call asks more of a rate window than its whole limit a minute: it could
    never be admitted (lower ``max_tokens``, or raise the limit)."""

    template = (
        "a call asks {ask} {kind} of the {provider} rate limit of {scope!r}, "
        "which is {per_minute} a minute: it could never be sent"
    )
    provider: str
    scope: str
    kind: str
    ask: int
    per_minute: int


class CapBelowCommitted(LedgerError):
    """A cap may not go below what its current period has already spent and holds:
    that money is committed. Freeze the budget to stop new admissions instead."""

    template = (
        "budget {budget!r}: its current period has spent and holds {committed}, so its "
        "cap cannot be {requested}; freeze it to stop new admissions"
    )
    budget: str
    requested: int
    committed: int


class IdempotencyConflict(LedgerError):
    """The key is already used for a different request (HTTP would say 422)."""

    template = "key {key!r} was used with {field}={recorded!r}, not {requested!r}"
    key: str
    field: str
    recorded: Any
    requested: Any


class UnknownAttempt(LedgerError):
    """No attempt has this key."""

    template = "unknown attempt {key!r}"
    key: str


class SettlementConflict(LedgerError):
    """The attempt is already settled or released with another actual amount."""

    template = "attempt {key!r} already settled at {recorded}, not {requested}"
    key: str
    recorded: int
    requested: int


class UsageRecorded(LedgerError):
    """The attempt's run recorded usage, which is proof of billing: it cannot be
    released, nor settled below that usage."""

    key: str
    recorded: int
    requested: int

    @property
    def message(self) -> str:
        wanted = "released" if self.requested == 0 else f"settled at {self.requested}"
        return (
            f"attempt {self.key!r} recorded usage of {self.recorded}, so it was billed: it "
            f"cannot be {wanted}; settle it at {self.recorded} or more"
        )


class InvalidTransition(LedgerError):
    """The attempt's state does not allow this step (e.g. a second mark_sending)."""

    template = "attempt {key!r} is {state}: cannot {action}"
    key: str
    state: str
    action: str


class UnknownOperation(LedgerError):
    """No operation has this idempotency key."""

    template = "unknown operation {key!r}"
    key: str


class CannotReopen(LedgerError):
    """Only a failed operation is reopened, and only while none of its calls holds money
    (reserved, in flight or unknown): its outcome would otherwise be decided twice."""

    template = "operation {key!r} cannot be reopened: {why}"
    key: str
    why: str


class PricingError(BudgetTasksError):
    """A cost could not be computed or bounded; nothing was reserved."""


class UnknownModelPrice(PricingError):
    """The price table has no entry for this model (a price is never guessed)."""

    template = (
        "no price for model {model!r} in price table {version}; add it or give an explicit estimate"
    )
    model: str
    version: str


class EstimateRefused(PricingError):
    """The request has no upper bound to estimate from (e.g. no max output tokens)."""

    template = "{reason}"
    reason: str


class RefusedEndpoint(EstimateRefused):
    """A request that may bill and that nothing bounds (a batch from an uploaded file, a
    realtime session, a POST no vendor knows): refused before it is sent. ``reason``
    says why; ``name`` is the rule to allow it by, if there is one."""

    method: str
    path: str
    name: str = ""

    @property
    def message(self) -> str:
        allow = (
            f"; let it through unmetered with allow=({self.name!r},) and reserve for it "
            "yourself (BudgetTask.spend)"
            if self.name
            else ""
        )
        return (
            f"{self.method} {self.path} is not metered and is refused before sending: "
            f"{self.reason}{allow}"
        )


class ProviderError(BudgetTasksError):
    """A provider call was refused or its outcome could not be read."""


class RetriesEnabled(ProviderError):
    """An SDK client with automatic retries: every retry that may bill must be a new,
    reserved attempt, so budget-tasks only accepts clients with ``max_retries=0``."""

    template = (
        "{client} has max_retries={max_retries!r}; budget-tasks needs max_retries=0 "
        "(use budget_tasks.transport.guarded_openai_client()/guarded_anthropic_client() "
        "or client.with_options(max_retries=0))"
    )
    client: str = ""
    max_retries: object = None


class SdkRetryRefused(RetriesEnabled):
    """The SDK sent a billable request again on its own (its ``x-stainless-retry-count``
    header says so): refused before it left. The first try keeps its hold; a retry that
    may bill is a new, reserved attempt, never the SDK's."""

    template = (
        "{client} retried POST {path} on its own (x-stainless-retry-count={retry}); "
        "refused before sending: build the client with max_retries=0 "
        "(budget_tasks.transport.guarded_openai_client()/guarded_anthropic_client())"
    )
    client: str = "the SDK"
    path: str = ""
    retry: str = ""


class UsageUnreadable(ProviderError):
    """An answer's usage that is not a count (a string of letters, a negative or an
    endless number, a usage that is no object): nothing is charged from it. The call's
    outcome is unknown and its hold kept, for reconciliation or an operator.
    ``value`` is how the answer showed it (a repr, cut short)."""

    template = (
        "the answer's usage {field} is {value}, not a count of tokens: its outcome is "
        "unknown and its hold kept"
    )
    field: str
    value: str


class ReportUnreadable(ProviderError):
    """A vendor's usage or cost report says something that is not a count, an amount
    in USD or a time: nothing is compared from it (never read as 0)."""

    template = "the {vendor} {report} report's {field} is {value}: not compared"
    vendor: str
    report: str
    field: str
    value: str


class DriftOff(ProviderError):
    """No admin key for a vendor's usage and cost reports: its drift is not checked."""

    template = "drift is off for {vendor}: no admin key in {variable}"
    vendor: str
    variable: str


class StreamIncomplete(ProviderError):
    """A stream ended before the provider said it was complete: the outcome is unknown."""

    template = "{provider} stream ended early ({detail}); outcome unknown"
    provider: str
    detail: str


class OutcomeUnknown(BudgetTasksError):
    """An earlier attempt of this operation may have billed and its outcome is unknown:
    under ``on_unknown="hold"`` nothing is resent; reconciliation decides."""

    template = (
        "operation {key!r}: the outcome of attempt {attempt!r} is unknown; its hold is "
        "kept and nothing is resent until reconciliation or an operator resolves it"
    )
    key: str
    attempt: str


class ResendRefused(BudgetTasksError):
    """A call is out under this attempt with no outcome reported (a timeout, a reset
    after sending): sending again under it could bill twice for one hold. Nothing is
    sent; the attempt keeps its hold. Let the error end the run: its hold stays as
    unknown, and a retry is a new attempt."""

    template = (
        "attempt {key!r} has a call out whose outcome is unknown: nothing more is sent "
        "under it; let the error end the run (its retry is a new attempt)"
    )
    key: str


class OperationInProgress(BudgetTasksError):
    """Another worker holds a live lease on this operation: retry later, no new charge."""

    template = "operation {key!r} is running elsewhere"
    key: str


class OperationFailed(BudgetTasksError):
    """The operation failed for good before; a redelivery reports that failure again."""

    template = "operation {key!r} failed before: {error}"
    key: str
    error: str | None


class PoisonMessage(BudgetTasksError):
    """The message's runs kept dying (a killed worker each time): it is stopped."""

    template = "operation {key!r} is stopped: {error}"
    key: str
    error: str | None


class SideEffectUncertain(BudgetTasksError):
    """A once() side effect started and never recorded its end: it is not run again."""

    template = (
        "side effect {name!r} of operation {key!r} started but its outcome was never "
        "recorded; it is not run twice"
    )
    key: str
    name: str


class AnswerNotKept(BudgetTasksError):
    """A stored result or answer was past the size cap (``budget_max_stored_bytes``),
    so only its digest and size were kept, or it was purged after the retention period
    while its operation was still unfinished: it cannot be replayed. It was paid for
    once and is not sent again; nothing was reserved or sent for this delivery."""

    template = "{key!r}: its stored answer cannot be replayed: {why}; it is not sent again"
    key: str
    why: str


class StepNotReplayable(BudgetTasksError):
    """A labelled call of this operation was billed and its result was not stored (its
    run failed after the call): running it again would send it again, so it is not
    (a task with ``rerun_billed=True`` allows it)."""

    template = (
        "operation {key!r}: call {attempt!r} was billed and its result is not stored; "
        "it is not sent again (rerun_billed=True allows it)"
    )
    key: str
    attempt: str


class NotBilled(Exception):
    """Raise from a task's ``run`` when the provider certainly did not bill: the hold is
    released instead of kept."""


class UnguardedCall(BudgetTasksError):
    """A billable request through the guarded transport outside a BudgetTask's run:
    refused before sending, so nothing bypasses the ledger by accident."""

    template = (
        "{method} {path} is billable and no BudgetTask runs on this thread: nothing was "
        "sent (make the call inside run(), or build the client with allow_unguarded=True)"
    )
    method: str
    path: str


class ParallelCallsUnlabelled(BudgetTasksError):
    """Two threads or asyncio tasks made calls at one label path in one run: the order
    of their positions would depend on scheduling. Refused before anything is sent."""

    template = (
        "calls at {path!r} come from two threads or tasks of one run at once: their "
        "positions would depend on which runs first, so a redelivery could hand one "
        "branch the other's stored answer. Nothing was sent. Wrap each branch's calls in "
        "budget_tasks.transport.call_label(<a name of its own>)"
    )
    path: str


class MissingApiKey(BudgetTasksError):
    """A guarded SDK client was built without an API key (none given, none in the
    environment), which lets a task module import where no key is needed (the CLI, a
    test suite with the fake provider). A billable request from it is refused before it
    is reserved or sent."""

    template = (
        "no {vendor} API key: the guarded client was built without one and {env} is not "
        "set; nothing was sent (set {env}, or give api_key=)"
    )
    vendor: str
    env: str


class UnusableApiKey(BudgetTasksError, ValueError):
    """An API key holds what no HTTP header may carry: a line break (a key read from a
    secret file with its last newline), a space or a byte outside ASCII. The HTTP
    library would refuse the header after money was held, and quote the key in its
    error; the client is refused as it is built. The message never shows the key."""

    template = (
        "the {vendor} API key ({source}) holds {what} at position {position}: no HTTP "
        "header may carry it; strip it (a key read from a file keeps its last newline)"
    )
    vendor: str
    source: str
    what: str
    position: int


class UnmeteredConnection(BudgetTasksError):
    """A connection to a provider endpoint opened inside a BudgetTask's ``run`` by a
    client that is not guarded: refused before any byte was sent."""

    template = (
        "a connection to the provider at {host}:{port} was opened inside a BudgetTask's "
        "run by a client that is not guarded: refused, nothing was sent. Use "
        "budget_tasks.transport.guarded_openai_client()/guarded_anthropic_client() (or "
        "their async twins, or http_client=guarded_http_client()); wrap an unbilled "
        "call in budget_tasks.bypass.unmetered() to let it through on purpose"
    )
    host: str
    port: int


class CallConflict(BudgetTasksError):
    """On a redelivery, the call at a position of the run sends another request body than
    the one stored there: the run is not deterministic up to that point."""

    template = (
        "operation {key!r}: call {attempt!r} now sends another request than the one it "
        "sent before; a redelivery replays calls by position, so the run must make the "
        "same calls in the same order (or use another idempotency key)"
    )
    key: str
    attempt: str


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
