"""The delivery's one voice to the hooks: every event a delivery reports about money
is said here, once, whichever call (the main one or a labelled one) it concerns; and
so is a delivery's life (started, decided, ended) and each provider call's (granted
its send, answered), which tracing draws."""

from __future__ import annotations

import threading
from contextvars import ContextVar, Token
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from ..errors import (
    BudgetExceeded,
    BudgetFrozen,
    LedgerUnavailable,
    OutcomeUnknown,
    RateWindowFull,
)
from ..hooks import Hooks
from .fates import HoldFate

#: What a call's hold became, as the outcome of a call an error ended.
_FATE_OUTCOME = {"settle": "settled", "release": "released", "unknown": "unknown"}
#: A lookup's name (``openai.chat``) as the GenAI operation it is.
_OPERATIONS = {
    "chat": "chat",
    "responses": "chat",
    "messages": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}


@dataclass
class _Tally:
    """One delivery's decision and what its calls' holds came to."""

    operation: str
    decision: str | None = None
    reserved: int = 0
    actual: int = 0
    overrun: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


#: The delivery running in this context (a labelled call in a thread started with the
#: run's context adds to it too).
_delivery: ContextVar[_Tally | None] = ContextVar("budget_tasks_delivery", default=None)


def _derived(exc: BaseException | None) -> str:
    """The decision of a delivery that ended before one was told, from how it ended."""
    cause = getattr(exc, "cause", exc)  # RetryLater carries what stopped it
    if isinstance(cause, BudgetExceeded | BudgetFrozen):
        return "denied"
    if isinstance(cause, OutcomeUnknown):
        return "unknown"
    if isinstance(cause, LedgerUnavailable):
        return "unavailable"
    if getattr(exc, "why", None) == "in_progress":
        return "in_progress"
    return "error"


class Told:
    """Tells ``sink`` what the deliveries of ``task`` did."""

    def __init__(self, sink: Hooks, task: str) -> None:
        self._sink = sink
        self._task = task
        #: attempt key -> its send a call is out on (granted, not yet reported)
        self._out: dict[str, int] = {}
        self._out_lock = threading.Lock()

    # -- a delivery's life ---------------------------------------------------------------

    def started(self, operation: str, budget: str) -> Token[_Tally | None]:
        token = _delivery.set(_Tally(operation))
        self._sink.delivery_started(task=self._task, operation=operation, budget=budget)
        return token

    def decided(
        self,
        operation: str,
        decision: str,
        attempt: str | None = None,
        estimate: int | None = None,
    ) -> None:
        tally = _delivery.get()
        if tally is not None and tally.operation == operation:
            tally.decision = decision
        self._sink.delivery_decided(
            task=self._task,
            operation=operation,
            decision=decision,
            attempt=attempt,
            estimate=estimate,
        )

    def finished(
        self, token: Token[_Tally | None], outcome: str, exc: BaseException | None = None
    ) -> None:
        """The delivery ended (``outcome``: ok, retry_later, error)."""
        tally = _delivery.get()
        _delivery.reset(token)
        if tally is None:
            return
        if tally.decision is None:
            self.decided(tally.operation, _derived(exc))
        error = None if exc is None else type(getattr(exc, "cause", exc)).__name__
        self._sink.delivery_ended(
            task=self._task,
            operation=tally.operation,
            outcome=outcome,
            reserved=tally.reserved,
            actual=tally.actual,
            overrun=tally.overrun,
            error=error,
        )

    # -- money ---------------------------------------------------------------------------

    def admitted(self, budget: str, attempt: str, amount: int) -> None:
        tally = _delivery.get()
        if tally is not None:
            with tally.lock:
                tally.reserved += amount
        self._sink.admitted(budget=budget, attempt=attempt, amount=amount)

    def denied(self, exc: BudgetExceeded | BudgetFrozen, amount: int) -> None:
        reason = "exceeded" if isinstance(exc, BudgetExceeded) else "frozen"
        self._sink.denied(budget=exc.budget, reason=reason, amount=amount)

    def rate_waited(self, exc: RateWindowFull) -> None:
        """A call's rate window was full: it was booked ``exc.wait`` seconds ahead."""
        self._sink.rate_limited(
            provider=exc.provider, scope=exc.scope, kind=exc.kind, wait=exc.wait, by="ledger"
        )

    def replayed(self, operation: str) -> None:
        self.decided(operation, "replay")
        self._sink.replayed(task=self._task, operation=operation)

    def unknown(self, attempt: str) -> None:
        self._sink.unknown(task=self._task, attempt=attempt)

    def ended(self, budget: str, attempt: str, amount: int, fate: HoldFate) -> None:
        """What a call's hold came to (a call still out on it ends so)."""
        self._call_closed(attempt, _FATE_OUTCOME[fate.action])
        if fate.untrusted:
            self._sink.untrusted(budget=budget, attempt=attempt, reason=fate.note, by="task")
        if fate.action == "unknown":
            self.unknown(attempt)
        elif fate.action == "settle":
            tally = _delivery.get()
            if tally is not None:
                with tally.lock:
                    tally.actual += fate.actual
                    tally.overrun += max(0, fate.actual - amount)
            self._sink.settled(
                budget=budget, attempt=attempt, amount=amount, actual=fate.actual, by="task"
            )
        else:
            self._sink.released(budget=budget, attempt=attempt, amount=amount, by="task")

    # -- provider calls ------------------------------------------------------------------

    def call_started(
        self,
        budget: str,
        attempt: str,
        send: int,
        amount: int,
        lookup: str | None,
        model: str | None,
    ) -> None:
        """A call was granted its send (``lookup``, ``model``: what it was described
        as, where it was before)."""
        system, _, kind = (lookup or "").partition(".")
        with self._out_lock:
            self._out[attempt] = send
        self._sink.call_started(
            budget=budget,
            attempt=attempt,
            send=send,
            amount=amount,
            system=system if kind else None,
            operation_name=_OPERATIONS.get(kind),
            model=model,
        )

    def call_answered(self, attempt: str, sent: Any, outcome: str) -> None:
        """The call out on ``attempt`` reported ``sent`` (a provider's ``Sent``)."""
        # read with care: what a task records may be its own object shaped like Sent,
        # and telling must never break the flow
        reported = getattr(sent, "usage", None)
        usage = None
        if is_dataclass(reported) and not isinstance(reported, type):
            usage = {k: v for k, v in asdict(reported).items() if isinstance(v, int) and v}
        self._call_closed(
            attempt,
            outcome,
            system=getattr(sent, "provider", None),
            model=getattr(sent, "model", None),
            usage=usage,
            actual=getattr(sent, "cost", None),
            request_id=getattr(sent, "request_id", None),
            response_id=getattr(sent, "response_id", None),
        )

    def call_reported(self, attempt: str, cost: int) -> None:
        """The call out on ``attempt`` reported its cost alone (``record_usage``)."""
        self._call_closed(attempt, "reported", actual=cost)

    def _call_closed(self, attempt: str, outcome: str, **facts: Any) -> None:
        with self._out_lock:
            send = self._out.pop(attempt, None)
        if send is not None:
            self._sink.call_ended(attempt=attempt, send=send, outcome=outcome, **facts)
