"""What an error means for a hold: the kinds of error (billed, not billed, refused
before sending, unknown), and what a call's hold becomes after ``run`` returns or
raises. No I/O here."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from .._redact import redact
from .._trust import untrusted_note
from ..errors import (
    AnswerNotKept,
    BudgetExceeded,
    BudgetFrozen,
    CallConflict,
    IdempotencyConflict,
    MissingApiKey,
    NotBilled,
    OutcomeUnknown,
    ParallelCallsUnlabelled,
    PricingError,
    RateAskTooLarge,
    RateWindowFull,
    RetriesEnabled,
    SideEffectUncertain,
    StepNotReplayable,
    UnguardedCall,
    UnknownBudget,
    UnmeteredConnection,
)
from ..ledger.records import not_kept
from ..providers.outcomes import ErrorOutcome, classify, never_sent


class Outcome(Protocol):
    """What a call has told of itself (see :class:`~.scope.Recorded`)."""

    amount: int
    actual: int | None
    used: bool
    in_flight: bool
    awaiting_usage: bool
    doubted: str | None


class ErrorKind(enum.Enum):
    """What an exception out of ``run`` (or a call inside it) means for a hold."""

    NOT_BILLED = "not_billed"  # the provider certainly did not bill the call
    NOT_SENT = "not_sent"  # no connection was made: nothing left, the same call may go again
    RATE_LIMITED = "rate_limited"  # 429: not billed; a retry is a new attempt
    UNKNOWN = "unknown"  # the call may have billed
    BEFORE_SEND = "before_send"  # the library refused before any byte was sent


#: Errors budget-tasks raises before anything is sent (for the call they concern).
BEFORE_SEND_ERRORS: tuple[type[BaseException], ...] = (
    AnswerNotKept,
    BudgetExceeded,
    BudgetFrozen,
    RateAskTooLarge,
    RateWindowFull,
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
    MissingApiKey,
)


def replayable(key: str, value: Any) -> Any:
    """``value`` (a stored result or answer), to be replayed; AnswerNotKept where only
    its digest was kept (it was past the size cap)."""
    marker = not_kept(value)
    if marker is not None:
        raise AnswerNotKept(key, str(marker.get("why", "it was not kept")))
    return value


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
    if never_sent(exc):
        return ErrorKind.NOT_SENT
    return {
        ErrorOutcome.NOT_BILLED: ErrorKind.NOT_BILLED,
        ErrorOutcome.RATE_LIMITED: ErrorKind.RATE_LIMITED,
        ErrorOutcome.UNKNOWN: ErrorKind.UNKNOWN,
    }[classify(exc)]


def describe_error(exc: BaseException) -> str:
    """An error as one line for the ledger and the log, without the credentials its
    text may quote (an HTTP library's refusal of a header names its value)."""
    text = redact(f"{type(exc).__name__}: {exc}")
    # one line: a provider's message may carry line breaks that would forge log lines
    return text.replace("\r", "\\r").replace("\n", "\\n")[:2000]


@dataclass(frozen=True)
class HoldFate:
    """What to write for one attempt's hold: release it, settle it, or keep it open."""

    action: str  # release | settle | unknown
    actual: int = 0
    estimate_only: bool = False
    note: str = ""
    #: (unknown) an answer's usage was past what its request allowed: never charged
    #: as it is, kept for an operator, and alerted on
    untrusted: bool = False


def _untrusted(call: Outcome) -> HoldFate:
    return HoldFate(
        "unknown", call.actual or 0, note=untrusted_note(call.doubted or ""), untrusted=True
    )


def fate_after_return(call: Outcome) -> HoldFate:
    """What a call's hold becomes when ``run`` returned (whatever happens next)."""
    if call.doubted is not None:
        return _untrusted(call)
    if call.awaiting_usage and call.actual is None:
        return HoldFate("unknown", note="answered without usage: settled when it is read")
    if call.actual is None:
        return HoldFate("settle", call.amount, True, "no usage recorded")
    return HoldFate("settle", call.actual, False)


def fate_after_error(call: Outcome, exc: BaseException) -> HoldFate:
    """What an error out of ``run`` (or a ``spend`` block) means for ``call``'s hold."""
    why = describe_error(exc)
    if call.doubted is not None:
        return _untrusted(call)
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
    if kind in (ErrorKind.NOT_BILLED, ErrorKind.NOT_SENT, ErrorKind.RATE_LIMITED):
        if call.actual:
            return HoldFate("settle", call.actual, False, f"billed, then {why}")
        return HoldFate("release", note=f"not billed: {why}")
    return HoldFate("unknown", call.actual or 0, note=why)
