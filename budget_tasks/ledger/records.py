"""Plain records the ledger returns. Money fields are ints of minor units."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .. import _validate as check
from .._rate_ask import RATE_KINDS as RATE_KINDS
from .._rate_ask import RateAsk as RateAsk
from .._rate_ask import RateSeen as RateSeen
from .._trust import Bound


@dataclass(frozen=True, slots=True)
class BudgetInfo:
    """A budget's configuration (its counters live per period, see :class:`Balance`)."""

    id: int
    name: str
    cap: int
    period: str
    renewal: str
    rollover_ceiling: int | None
    tenant: str | None
    parent: str | None
    frozen: bool
    #: admits against grants drawn from its ancestors (see ``create_budget``)
    escrow: bool = False
    #: how many rows its money is split over (see ``set_slices``)
    slices: int = 1
    #: its weight in the rate windows its calls share (see ``set_rate_weight``)
    rate_weight: int | None = None


#: How an attempt records a call sent with no finite timeout (``timeout_ms`` 0): the
#: provider may work on it for ever, so not finding it never proves it was not billed.
NO_TIMEOUT_MS = 0


#: What a stored result or answer past the size cap is replaced by: its digest and size.
NOT_KEPT = "budget_tasks_not_kept"
#: The default size cap of one stored result or answer (bytes of its JSON).
DEFAULT_MAX_STORED_BYTES = 1 << 20
MAX_STORED_ENV = "BUDGET_TASKS_MAX_STORED_BYTES"


def stored_limit(value: int | None) -> int:
    """The size cap: ``value``, else ``BUDGET_TASKS_MAX_STORED_BYTES``, else 1 MiB."""
    if value is None:
        raw = os.environ.get(MAX_STORED_ENV)
        value = DEFAULT_MAX_STORED_BYTES if not raw else int(raw)
    return check.positive(value, "max_stored_bytes")


def kept(encoded: str, limit: int) -> str:
    """``encoded`` (JSON) as it is stored for replay: itself up to ``limit`` bytes;
    past it, only its sha256 and its size (``{"budget_tasks_not_kept": {...}}``): a
    replay of it is refused."""
    size = len(encoded.encode("utf-8")) if not encoded.isascii() else len(encoded)
    if size <= limit:
        return encoded
    digest = hashlib.sha256(encoded.encode("utf-8")).hexdigest()
    why = f"it was {size} bytes, past the size cap of {limit}: only its sha256 {digest} was kept"
    return json.dumps({NOT_KEPT: {"sha256": digest, "bytes": size, "limit": limit, "why": why}})


#: What the purge leaves of a stored result an unfinished operation may still replay.
PURGED = json.dumps({NOT_KEPT: {"why": "it was purged after the retention period"}})
#: What the purge leaves of a finished operation's error text.
PURGED_ERROR = "(its error text was purged after the retention period)"


def not_kept(value: Any) -> dict[str, Any] | None:
    """What a stored value past the size cap kept of itself (digest, size), or None."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(NOT_KEPT), dict):
        marker: dict[str, Any] = value[NOT_KEPT]
        return marker
    return None


#: The lookup of an attempt whose answer reported usage past what its request allowed:
#: none finds it, so nothing charges that usage as found (an operator resolves it).
UNTRUSTED_LOOKUP = "untrusted"


def seen_params(seen: RateSeen | None) -> dict[str, Any]:
    """What a provider's answer said of its rate limits, as the statements' parameters
    (``seen_at_ms`` None: it said nothing)."""
    return {
        "seen_at_ms": None if seen is None else seen.at_ms,
        "seen_requests": None if seen is None else seen.requests,
        "seen_tokens": None if seen is None else seen.tokens,
        "seen_input": None if seen is None else seen.input_tokens,
        "seen_output": None if seen is None else seen.output_tokens,
        "seen_wait_ms": None if seen is None else seen.wait_ms,
        **{
            f"seen_{kind}_limit": None if seen is None else seen.limit_of(kind)
            for kind in RATE_KINDS
        },
    }


@dataclass(frozen=True, slots=True)
class RateClaim:
    """Which rate windows a call takes from, and what: ``provider``'s windows whose
    scope is one of ``scopes`` (its model, the groups it is in, ``*``, its key), each
    taking ``ask`` of its kind."""

    provider: str
    scopes: tuple[str, ...]
    ask: RateAsk = field(default_factory=RateAsk)
    #: the scopes that are the call's own model's (its name, without its date): a
    #: limit the provider states for the call lowers these windows, never the shared
    own: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check.text(self.provider, "provider", max_length=64)
        if not self.scopes:
            raise ValueError("a rate claim names at least one scope")
        for scope in self.scopes:
            check.text(scope, "rate scope", max_length=100)
        if not set(self.own) <= set(self.scopes):
            raise ValueError("a rate claim's own scopes are among its scopes")


@dataclass(frozen=True, slots=True)
class Answered:
    """What a call's answer said, written with its settlement (or its unknown): the
    provider's request and response ids, the vendor it was sent to, the hint of the API
    key that sent it (never the key: see ``providers.reports.hint_of``), the model that
    answered (a snapshot of the one asked for), and the tokens it used as the vendor's
    usage reports count them: every input token however billed (cache reads and writes
    too), and output with reasoning (0 for an endpoint whose tokens those reports do not
    count). The drift check compares these with the vendor's reports."""

    request_id: str | None = None
    response_id: str | None = None
    provider: str | None = None
    credential: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    answered_by: str | None = None
    #: what the vendor's rate limits count the call as in the end: the tokens its
    #: admission took and this does not count go back to its windows
    counted: RateAsk | None = None
    #: what the provider's answer said remains of its rate limits: the call's windows
    #: are narrowed to it
    seen: RateSeen | None = None

    def __post_init__(self) -> None:
        check.optional_text(self.request_id, "request_id")
        check.optional_text(self.response_id, "response_id", max_length=255)
        check.optional_text(self.provider, "provider", max_length=64)
        check.optional_text(self.credential, "credential", max_length=64)
        check.optional_text(self.answered_by, "answered_by", max_length=100)
        for name in ("input_tokens", "output_tokens"):
            value = getattr(self, name)
            if value is not None:
                check.count(value, name)

    def params(self) -> dict[str, Any]:
        """The statements' parameters of the same names."""
        return {
            "request_id": self.request_id,
            "response_id": self.response_id,
            "provider": self.provider,
            "credential": self.credential,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "answered_by": self.answered_by,
        }

    def rate_params(self) -> dict[str, Any]:
        """What goes back to the call's rate windows: the tokens it was counted as
        (None: not known, nothing goes back)."""
        counted, seen = self.counted, self.seen
        return {
            "counted_tokens": None if counted is None else counted.tokens,
            "counted_input": None if counted is None else counted.input_tokens,
            "counted_output": None if counted is None else counted.output_tokens,
            **seen_params(seen),
        }


#: Nothing said (an operator's resolution, a release).
NOTHING_ANSWERED = Answered()

#: What a run may write for one of its calls (see :class:`CallEnd`).
CALL_ACTIONS = frozenset({"settle", "release", "unknown", "store", "unsent"})


@dataclass(frozen=True, slots=True)
class CallEnd:
    """What one call of a run came to, the main call or a labelled one: ``action``
    ``settle`` (at ``actual``; ``estimate_only`` when no usage was recorded),
    ``release`` (nothing was billed), ``unknown`` (the hold stays; ``note`` says why),
    ``store`` (the hold is resolved already) or ``unsent`` (an admission whose answer
    was lost may have granted a send that the run never made: released if it did and
    the attempt is still ``sending`` under the run's lease, else nothing).
    ``answered`` is what its answer said (:class:`Answered`), written with it. ``untrusted``
    (with ``unknown``): its answer's usage was past what its request allowed, so no
    lookup charges it as found; an operator resolves it."""

    key: str
    action: str
    actual: int = 0
    estimate_only: bool = False
    note: str | None = None
    answered: Answered = NOTHING_ANSWERED
    untrusted: bool = False

    def __post_init__(self) -> None:
        check.text(self.key, "key")
        check.money(self.actual, "actual")
        if self.action not in CALL_ACTIONS:
            raise ValueError(f"action must be one of {sorted(CALL_ACTIONS)}, not {self.action!r}")


@dataclass(frozen=True, slots=True)
class SettledCall:
    """A labelled call that was answered and priced, with the answer a redelivery
    replays (stored under ``record``): written in the run's next commit (the next
    call's admission, or the run's end) instead of one of its own."""

    call: CallEnd
    record: str
    result: Any = None

    def __post_init__(self) -> None:
        if self.call.action != "settle":
            raise ValueError(f"only a settlement waits for a later commit: {self.call.action!r}")
        check.text(self.record, "side effect name")


@dataclass(frozen=True, slots=True)
class CallFacts:
    """What a call is, known before it is sent: the lookup that finds it again, the
    model it is priced at, the client timeout it is sent with (seconds; ``math.inf``
    for none), the digest of its request (a found answer is adopted only for the same
    request). Written with the admission that grants its send, so that reconciliation
    can find it should the run die mid-call."""

    lookup: str | None = None
    model: str | None = None
    timeout: float | None = None
    request: str | None = None
    #: the most tokens the request allowed, which its answer's usage is vetted against
    bound: Bound | None = None
    #: the rate windows its send takes from, in the admission's transaction
    rate: RateClaim | None = None

    def __post_init__(self) -> None:
        for name, value, limit in (
            ("lookup", self.lookup, 32),
            ("model", self.model, 100),
            ("request", self.request, 64),
        ):
            if value is not None:
                check.text(value, name, max_length=limit)
        timeout = self.timeout
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(f"timeout must be seconds, not {type(timeout).__name__}")
            if not (0 < timeout < 10**7 or timeout == math.inf):
                raise ValueError(
                    f"timeout must be a positive number of seconds or math.inf, not {timeout}"
                )

    @property
    def timeout_ms(self) -> int | None:
        if self.timeout is None:
            return None
        if self.timeout == math.inf:
            return NO_TIMEOUT_MS
        return max(1, math.ceil(self.timeout * 1000))

    def covers(self, other: CallFacts) -> bool:
        """Whether writing ``other`` would change nothing this records."""
        return all(
            theirs is None or theirs == ours
            for theirs, ours in (
                (other.lookup, self.lookup),
                (other.model, self.model),
                (other.timeout_ms, self.timeout_ms),
                (other.request, self.request),
                (other.bound, self.bound),
            )
        )


@dataclass(frozen=True, slots=True)
class CallAsk:
    """What one call of an operation asks to be admitted with, the main call (call 0)
    or a labelled one: the budget it is charged to, the amount it reserves, the
    request's fingerprint, the prices the amount was estimated at, and what the call is
    (written with its grant). A labelled call also names its label and its position
    (``step``: the key of its first attempt)."""

    budget: str
    amount: int
    fingerprint: str | None = None
    price_version: str | None = None
    facts: CallFacts = CallFacts()
    label: str | None = None
    step: str | None = None

    def __post_init__(self) -> None:
        check.text(self.budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        check.money(self.amount)
        check.optional_text(self.fingerprint, "fingerprint")
        check.optional_text(self.price_version, "price_version", max_length=64)
        check.optional_text(self.label, "label", max_length=100)
        check.optional_text(self.step, "step")
        if (self.label is None) != (self.step is None):
            raise ValueError("a labelled call names both its label and its step")


@dataclass(frozen=True, slots=True)
class AttemptRef:
    """An attempt as a delivery's decisions see it."""

    key: str
    state: str
    amount: int
    reason: str
    label: str | None = None
    #: JSON text of the answer a reconciliation found, if any
    answer: str | None = None
    #: usage a run recorded before the attempt's outcome became unknown
    recorded_actual: int | None = None


@dataclass(frozen=True, slots=True)
class CallAdmission:
    """One call's admission at its position (the same for the main call and a labelled
    one): the latest attempt there and how many it has had, the attempt the admission
    made (reserved, granted and described at once), if it made one.

    The main call's admission also names the operation's next reason (why its next
    attempt runs) and the labelled calls an earlier run left open; a labelled call's,
    the answer stored for it (it completed before: replay it)."""

    operation_id: int
    latest: AttemptRef | None = None
    count: int = 0
    reservation: Reservation | None = None
    next_reason: str | None = None
    others_open: tuple[AttemptRef, ...] = ()
    stored: tuple[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """A hold on a budget for one attempt.

    ``created`` is True only for the call that placed the hold. A False value means the
    key already existed: it is never a new permission to send.
    """

    key: str
    budget: str
    amount: int
    period_start: datetime
    state: str
    reason: str
    fingerprint: str | None
    created: bool


@dataclass(frozen=True, slots=True)
class Balance:
    """A budget's counters for one period. ``available`` may be negative after overruns.

    ``spent`` and ``held`` are the budget's whole tree's: what was admitted on it and on
    every budget under it (its slices, its escrowed tenants and theirs) in the periods
    inside this one. ``granted`` is what the escrowed budgets under it hold of their
    grants unused: it is part of ``available`` (an admission takes it back). ``drawn``
    is what an escrowed budget's period holds as grants from its ancestors.
    ``available`` is ``cap - spent - held``."""

    budget: str
    cap: int
    spent: int
    held: int
    available: int
    period_start: datetime
    granted: int = 0
    drawn: int = 0


@dataclass(frozen=True, slots=True)
class BudgetReport:
    """A budget's current period and its oldest open hold, as reports show them."""

    budget: str
    cap: int
    spent: int
    held: int
    available: int
    period_start: datetime
    frozen: bool
    oldest_hold: timedelta | None
    #: charged above reservations in this period, by every settler
    overrun: int = 0
    #: held unused by the escrowed budgets below, and drawn from the ancestors (see Balance)
    granted: int = 0
    drawn: int = 0
    #: what it can still admit: its available, and no more than its parent can (whose
    #: available counts the grants below it held unused: an admission takes them back);
    #: 0 under a freeze here or above, never negative. Tenants share their parent's room.
    usable: int = 0


@dataclass(frozen=True, slots=True)
class SettledStats:
    """A budget's attempts settled in its current period: how many, what they were
    estimated at and charged, and how many were charged above their estimate (an
    overrun) and by how much in all (minor units)."""

    settled: int
    estimated: int
    charged: int
    overruns: int
    overrun: int


@dataclass(frozen=True, slots=True)
class Attempt:
    """One potentially billable send and where it stands."""

    key: str
    budget: str
    amount: int
    actual: int | None
    state: str
    reason: str
    fingerprint: str | None
    provider: str | None
    request_id: str | None
    note: str | None
    period_start: datetime
    created_at: datetime
    sending_at: datetime | None
    resolved_at: datetime | None
    price_version: str | None = None
    label: str | None = None
    estimate_only: bool = False
    lookup: str | None = None
    model: str | None = None
    response_id: str | None = None
    lookups: int = 0
    flagged_at: datetime | None = None
    operation_key: str | None = None
    #: usage the run recorded (proof of billing), before the attempt was resolved
    recorded_actual: int | None = None
    #: a labelled call's position in its operation (its first attempt's key)
    step: str | None = None
    #: the client timeout the call was sent with, in milliseconds (0: none, unbounded)
    timeout_ms: int | None = None
    #: the digest of the request it sent (a found answer is adopted only for it)
    request_digest: str | None = None
    #: the most input and output tokens its request allowed (None: not known)
    input_bound: int | None = None
    output_bound: int | None = None
    #: what its answer said it used (input however billed; output with reasoning), and
    #: the hint of the API key it was sent with (None: not said)
    input_tokens: int | None = None
    output_tokens: int | None = None
    credential: str | None = None
    #: the model that answered (a snapshot of ``model``, the one asked for)
    answered_by: str | None = None

    @property
    def bound(self) -> Bound | None:
        """What the request allowed, which a found answer's usage is vetted against."""
        if self.input_bound is None or self.output_bound is None:
            return None
        return Bound(self.input_bound, self.output_bound)

    @property
    def overrun(self) -> int:
        """How much the actual charge exceeded the reservation (0 if it did not)."""
        return max(0, (self.actual or 0) - self.amount)


@dataclass(frozen=True, slots=True)
class Hold:
    """An attempt that still holds money, with its age."""

    key: str
    budget: str
    amount: int
    state: str
    reason: str
    provider: str | None
    request_id: str | None
    note: str | None
    period_start: datetime
    created_at: datetime
    age: timedelta
    flagged_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class AuditFinding:
    """A budget period whose counter differs from the sum of its journal entries."""

    budget: str
    period_start: datetime
    counter: str
    recorded: int
    journal: int


@dataclass(frozen=True, slots=True)
class Operation:
    """One business intent: its status, stored outcome and delivery counts."""

    key: str
    status: str
    task: str | None
    result: Any
    error: str | None
    payload: Any
    #: runs that took the lease and never recorded their end (killed workers): a
    #: delivery finding ``max_deliveries`` of them stops the message as poison
    runs: int
    deliveries: int
    replays: int
    created_at: datetime
    completed_at: datetime | None
    #: ``host:pid:token`` of the delivery running it now, or that ran it last
    lease_owner: str | None = None


@dataclass(frozen=True, slots=True)
class OperationEvent:
    """What an operator did to an operation (reopening a failed one), who and why."""

    kind: str
    from_status: str
    to_status: str
    by: str
    note: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One journal row, in one budget's period (a chain of budgets has one row per
    budget): an attempt's hold, charge, release or adjustment, or an operator's
    action (``attempt`` None for a cap change, a freeze, an unfreeze, a reopen)."""

    attempt: str | None
    budget: str
    kind: str
    held_delta: int
    spent_delta: int
    note: str | None
    created_at: datetime
    #: who acted, where an operator did (None: a run or beat)
    actor: str | None = None


@dataclass(frozen=True, slots=True)
class Purged:
    """What one purge removed, past the retention period: ``operations`` finished
    whose result, arguments and error text went; ``unfinished`` operations (still
    unknown or waiting) whose arguments went; ``side_effects`` (labelled calls'
    answers, ``once`` results) and ``attempts`` (a found answer, the error text of
    their notes) cleared. An unfinished operation's answers are replaced by a marker:
    a later run that would replay one is refused (AnswerNotKept), never resends."""

    operations: int = 0
    unfinished: int = 0
    side_effects: int = 0
    attempts: int = 0

    @property
    def total(self) -> int:
        return self.operations + self.unfinished + self.side_effects + self.attempts


@dataclass(frozen=True, slots=True)
class Resolved:
    """What resolving an attempt from outside its run did, to it and its operation."""

    key: str
    #: False when the attempt was already resolved with the same charge
    applied: bool
    state: str
    actual: int
    amount: int
    operation: str | None = None
    #: where the operation stands now (None: not touched, e.g. a later attempt exists)
    operation_status: str | None = None
    operation_changed: bool = False


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """One journal partition as retention sees it.

    ``state``: ``none`` (budgets without a period: never archived), ``default`` (rows
    whose month had no partition: never archived), ``ahead``, ``current``, ``kept``
    (inside the window), ``due`` (the next run archives it), ``blocked`` (past the
    window, with ``blockers`` saying why), or ``archived`` (gone; ``kept_as`` says
    where it went). ``rows`` is PostgreSQL's estimate (None: never analysed)."""

    name: str
    month: datetime | None
    state: str
    rows: int | None = None
    bytes: int = 0
    blockers: tuple[str, ...] = ()
    kept_as: str | None = None


@dataclass(frozen=True, slots=True)
class Retained:
    """What one retention run did: the months ``archived`` (their partitions), those
    ``blocked`` and why, and the ``attempts`` and ``operations`` rows it removed."""

    archived: tuple[str, ...] = ()
    blocked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    attempts: int = 0
    operations: int = 0
