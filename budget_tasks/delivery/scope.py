"""What the code inside a task sees: its run's main attempt (``self.attempt``), its
labelled calls (``spend()``, the guarded transport), and which run is in progress in
this context and in this process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

from .. import _validate as check
from .._rate_ask import RATE_KINDS, RateAsk, RateSeen
from .._trust import Bound, doubt
from ..errors import LedgerUnavailable, ResendRefused
from ..ledger import CallFacts, CallLedger
from ..ledger.records import Answered, SettledCall
from .fates import before_send
from .told import Told

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


class Calls(Protocol):
    """What opens a run's labelled calls (the delivery flow, as the run sees it)."""

    ledger: Any

    def step(
        self,
        scope: AttemptScope,
        amount: int,
        label: str,
        call: CallFacts | None = None,
        price_version: str | None = None,
    ) -> AbstractContextManager[Call]: ...


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
        bound: Bound | None = ...,
    ) -> None: ...


class Recorded:
    """One billable attempt as the code inside a task sees it.

    Reading :attr:`key` marks a call as out until it reports. What a call reports (its
    request and response ids, its usage) is kept here and written with the attempt's
    settlement, in the same commit; only a call answered without its usage (a background
    Response) has its ids written at once, since reconciliation reads it by them."""

    def __init__(
        self,
        key: str,
        amount: int,
        ledger: Any = None,
        described: CallFacts | None = None,
        *,
        told: Told | None = None,
        budget: str = "",
    ) -> None:
        self._key = key
        self.amount = amount
        self.actual: int | None = None
        self.request_id: str | None = None
        self.response_id: str | None = None
        #: what the answers said of who sent them and what they used (for drift)
        self.provider: str | None = None
        self.credential: str | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.answered_by: str | None = None
        #: what the vendor's rate limits counted its answers as (summed)
        self.counted: RateAsk | None = None
        #: what the provider's last answer said remains of its rate limits
        self.rate_seen: RateSeen | None = None
        self._ledger: _Grants | None = ledger
        #: what the ledger records of the call (written with the admission)
        self._described = described
        #: someone asked for the key: a call may have been sent under it
        self.used = False
        #: a call on this attempt may be out (the key was read since its last report)
        self.in_flight = False
        #: a call answered without its usage (a background response): settled later
        self.awaiting_usage = False
        #: why an answer's usage cannot be charged as it is (past what its request
        #: allowed, or the ledger's ceiling): its hold stays unknown for an operator
        self.doubted: str | None = None
        #: who hears of each send (call started, answered), and the budget it charges
        self._told = told
        self._budget = budget
        self._sends = 0

    @property
    def key(self) -> str:
        """The attempt key (the provider's Idempotency-Key). Asking for it marks a call
        as out until it reports (``record``/``record_usage``); asking again while a call
        is out with no report (it timed out) is refused (ResendRefused): one attempt is
        one send."""
        if self.in_flight:
            raise ResendRefused(self._key)
        self.used = True
        self.in_flight = True
        if self._told is not None:
            self._sends += 1
            facts = self._described
            self._told.call_started(
                self._budget,
                self._key,
                self._sends,
                self.amount,
                None if facts is None else facts.lookup,
                None if facts is None else facts.model,
            )
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
    def answered(self) -> Answered:
        """What the call's answers said (ids, vendor, key hint, tokens), for its
        settlement."""
        return Answered(
            self.request_id,
            self.response_id,
            self.provider,
            self.credential,
            self.input_tokens,
            self.output_tokens,
            self.answered_by,
            self.counted,
            self.rate_seen,
        )

    def record_usage(self, cost: int) -> None:
        """The actual cost of the call, in minor units (sums over several reports),
        settled at once when the attempt settles: a recorded actual is proof of
        billing, and whatever happens after, the hold is settled at it, never released."""
        check.money(cost, "cost")
        self.actual = (self.actual or 0) + cost
        self.in_flight = False
        if self._told is not None:
            self._told.call_reported(self._key, cost)

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
        bound: Bound | None = None,
    ) -> None:
        """Record what the call is, before it is sent, for reconciliation. Where the
        admission described it so already, nothing is written."""
        facts = CallFacts(lookup, model, timeout, request, bound)
        # Where the admission described the call (describe_call), its request digest
        # alone is not worth a commit of its own: the provider key already keeps another
        # installation's, or another attempt's, answer from being adopted. Nor is its
        # bound: this run vets its own answer by it (record); reconciliation, without
        # it, vets a found answer against the money ceiling only.
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
                    bound=bound,
                )
            except LedgerUnavailable as exc:
                raise before_send(exc) from None
        self._described = facts

    def record(self, sent: Any) -> None:
        """Keep a guarded call's request id, response id and priced usage for the
        settlement. A call answered without usage (a background response) keeps its hold
        open until reconciliation reads the usage: its ids are written at once. Usage
        past what the request allowed (see :mod:`budget_tasks._trust`) is not kept: the
        hold stays unknown for an operator."""
        if sent.request_id:
            self.request_id = sent.request_id
        if sent.response_id:
            self.response_id = sent.response_id
        self.provider = sent.provider or self.provider
        self.credential = getattr(sent, "credential", None) or self.credential
        why = doubt(sent.usage, sent.cost, getattr(sent, "bound", None))
        if why is not None:
            self.doubted = why
            self.in_flight = False
            self._tell_answered(sent, "untrusted")
            return
        if sent.cost is not None:
            self.actual = (self.actual or 0) + sent.cost
            if sent.usage is not None:
                # as the vendor's usage reports count them: not at all for an endpoint
                # they count in other units (images, characters)
                counted = getattr(sent, "tokens_reported", True)
                self.input_tokens = (self.input_tokens or 0) + (
                    sent.usage.input_total if counted else 0
                )
                self.output_tokens = (self.output_tokens or 0) + (
                    sent.usage.output_tokens if counted else 0
                )
                self.answered_by = sent.model or self.answered_by
                self.counted = _added(self.counted, getattr(sent, "rate_counted", None))
        else:
            self.awaiting_usage = True
        self.in_flight = False
        self._tell_answered(sent, "answered" if sent.cost is not None else "awaiting_usage")
        if sent.cost is None and self._ledger is not None:
            self._ledger.record_call(
                self._key, request_id=sent.request_id, response_id=sent.response_id
            )

    def _tell_answered(self, sent: Any, outcome: str) -> None:
        if self._told is not None:
            self._told.call_answered(self._key, sent, outcome)


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
        manager: Calls | None = None,
        owner: str = "",
        described: CallFacts | None = None,
        next_reason: str | None = None,
        told: Told | None = None,
    ) -> None:
        super().__init__(key, amount, ledger, described, told=told, budget=budget)
        self.owner = owner
        #: why the main attempt exists (a labelled call's first attempt shares it)
        self.reason = reason
        #: why the operation runs again, if it was told (manual: an operator reopened it)
        self.next_reason = next_reason
        self.operation_key = operation_key
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
        #: the run made a labelled call (spend(), the guarded transport)
        self.made_calls = False
        self._operation_id = operation_id
        #: whether the main call has an attempt in the ledger (a run admitted with its
        #: first call, whose main call reserves nothing, has none)
        self.has_main = True
        #: what admits the run, while its lease is deferred to its first call (see
        #: :meth:`defer`); None once admitted
        self._admission: Callable[[Any], Any] | None = None
        self._admission_lock = threading.Lock()
        #: why the run cannot go on (its deferred admission found it replayed, taken,
        #: or the ledger down), kept should the run's code swallow what was raised
        self.stopped: BaseException | None = None
        #: the refusal its deferred admission recorded (the run was never admitted)
        self.refused_unadmitted: BaseException | None = None
        #: calls answered and priced whose settlement waits for the run's next commit
        self._settled: list[SettledCall] = []
        self._settled_lock = threading.Lock()

    @property
    def operation_id(self) -> int:
        """The operation's id in the ledger; asking for it admits a deferred run."""
        if self._admission is not None:
            self.admit_first(None)
        return self._operation_id

    @property
    def admitted(self) -> bool:
        """Whether the run's admission has committed (see :meth:`defer`)."""
        return self._admission is None

    def defer(self, admission: Callable[[Any], Any]) -> None:
        """Defer the run's admission: ``admission(first)`` runs it (raising what stops
        the run), with its first call's admission (``first``) where one asks."""
        self._admission = admission

    def admit_first(self, first: Any) -> Any:
        """Admit the deferred run with its first call (``(ask, record, plan)``): that
        call's admission, or None where it was not made with the run's."""
        # threads the run started may call at once: one admits, the others then find
        # the run admitted (and their calls are admitted on their own)
        with self._admission_lock:
            if self._admission is None:
                return None
            return self._admission(first)

    def admitted_as(
        self,
        key: str | None,
        operation_id: int,
        *,
        reason: str,
        next_reason: str | None,
        described: CallFacts | None = None,
    ) -> None:
        """The deferred admission committed: the operation and the main attempt it
        made (``key`` None: none, the run was admitted with its first call)."""
        if key is None:
            self.has_main = False
        else:
            self._key = key
        self._operation_id = operation_id
        self.reason = reason
        self.next_reason = next_reason
        self._described = described
        self._admission = None

    def keep(self, settled: SettledCall) -> None:
        """Keep a call's settlement for the run's next commit."""
        with self._settled_lock:
            self._settled.append(settled)

    def take_settled(self) -> list[SettledCall]:
        """The settlements kept for the next commit, handed over (give them back with
        :meth:`put_back` if that commit fails)."""
        with self._settled_lock:
            taken, self._settled = self._settled, []
        return taken

    def put_back(self, settled: list[SettledCall]) -> None:
        with self._settled_lock:
            self._settled[:0] = settled

    def position(self, label: str, request: str | None) -> int:
        """The position of this run's next call labelled ``label``: the next one, or
        the same again for the request the provider refused there just before."""
        self.made_calls = True
        seq = self._labels.get(label, 0)
        refused = self._refused.pop(label, None)
        if not (seq and refused is not None and refused == request):
            # A request sent again after the provider refused it (a retry in the task's
            # own code) stays at its position: a redelivery that meets the position
            # answered replays that answer, instead of sending the request once more.
            seq += 1
        self._labels[label] = seq
        return seq

    def refused(self, label: str, request: str | None) -> None:
        """The provider refused the call just made at ``label`` (unbilled)."""
        if request is not None:
            self._refused[label] = request

    def describe(self, *args: Any, **kwargs: Any) -> None:
        """As :meth:`Recorded.describe`, on the main attempt (refused where
        ``estimate_cost`` was 0: see :attr:`key`)."""
        self._check_reserved()
        super().describe(*args, **kwargs)

    def record(self, sent: Any) -> None:
        """As :meth:`Recorded.record`, on the main attempt (refused where
        ``estimate_cost`` was 0)."""
        self._check_reserved()
        super().record(sent)

    def record_usage(self, cost: int) -> None:
        """As :meth:`Recorded.record_usage`, on the main attempt (refused where
        ``estimate_cost`` was 0)."""
        self._check_reserved()
        super().record_usage(cost)

    def _check_reserved(self) -> None:
        if self.amount == 0:
            raise ValueError(
                f"operation {self.operation_key!r}: estimate_cost is 0, so nothing was "
                "reserved for a call under the main attempt; give an estimate, or make "
                "the calls with self.spend(...) or through the guarded transport"
            )

    @property
    def key(self) -> str:
        """The main attempt's key. Refused when ``estimate_cost`` was 0: nothing is
        reserved for a call under it (use ``spend()`` or the guarded transport)."""
        self._check_reserved()
        return super().key

    @property
    def ledger(self) -> CallLedger:
        """The ledger this run's calls are written to."""
        assert self.manager is not None
        ledger: CallLedger = self.manager.ledger
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
        told: Told | None = None,
        budget: str = "",
    ) -> None:
        super().__init__(key, amount, ledger, described, told=told, budget=budget)
        self.label = label
        self.replayed = replayed
        self.result = result
        self.reconciled = reconciled

    def record(self, sent: Any, result: Any = None) -> None:
        """Record the call's ids and cost, and the result to replay on redelivery."""
        super().record(sent)
        self.result = sent.result if result is None else result


def _added(total: RateAsk | None, more: RateAsk | None) -> RateAsk | None:
    """Two counts of one call's answers, added (a call that reports twice)."""
    if more is None or total is None:
        return more or total
    return RateAsk(*(total.of(kind) + more.of(kind) for kind in RATE_KINDS))
