"""One path for every billable call of a run.

The main call is call 0 of its operation; a labelled call (``spend()``, the guarded
transport) sits at its label's position. Every call is admitted with the same plan,
decided by the same rules after what an earlier run left at its position, granted its
send the same way, and replayed the same way. What differs is only what its caller
does with an error: before ``run`` (the main call) the delivery ends its run; inside
``run`` (a labelled call) the error is raised into it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ..errors import (
    BudgetExceeded,
    BudgetFrozen,
    InvalidTransition,
    LedgerUnavailable,
    RateWindowFull,
    StepNotReplayable,
)
from ..ledger import CallLedger, Reservation
from ..ledger.records import AttemptRef, CallAdmission, CallAsk
from ..ledger.states import OPEN, AttemptState, nothing_sent_under
from .keys import main_key, step_key
from .options import DeliveryOptions
from .told import Told

T = TypeVar("T")

#: How often a call waiting its turn in a rate window's line reads its turn again.
TURN_READ_SECONDS = 0.25

#: Where a labelled call's answer is stored for replay (the main call's answer is the
#: operation's result).
_STEP_RECORD = "spend:{label}:{seq}"


@dataclass(frozen=True)
class CallSite:
    """Where one call sits in its operation, and what it asks to be admitted with."""

    operation: str
    ask: CallAsk
    #: the label's position in the run (0: the main call)
    seq: int = 0
    #: why the run exists: the reason of a call's first attempt at its position
    run_reason: str = "first"
    #: why the operation runs again, if it was told (``manual``: an operator reopened it)
    next_reason: str | None = None

    @property
    def record(self) -> str | None:
        label = self.ask.label
        return None if label is None else _STEP_RECORD.format(label=label, seq=self.seq)

    def key(self, count: int) -> str:
        """The key of the attempt that follows ``count`` earlier ones here."""
        label = self.ask.label
        if label is None:
            return main_key(self.operation, count + 1)
        return step_key(self.operation, label, self.seq, count + 1)

    def reason(self, latest: AttemptRef | None) -> str:
        """Why a new attempt here exists, after ``latest``."""
        if latest is None:
            return self.run_reason
        if latest.state in OPEN:
            return "unknown_resend"
        return self.next_reason or "redelivery"


@dataclass(frozen=True)
class Send:
    """Send under ``key``: a new attempt to reserve for ``reason``, or (``reuse``) one
    reserved before and never sent, at the same amount."""

    key: str
    reason: str
    reuse: bool = False


@dataclass(frozen=True)
class Opened:
    """The call may send under ``key`` (which exists for ``reason``); ``described``:
    its admission wrote what the call is."""

    key: str
    reason: str
    described: bool


@dataclass(frozen=True)
class AnswerFound:
    """Reconciliation found the answer of the call's latest attempt: replay it."""

    attempt: AttemptRef


class Moved(Exception):
    """Internal: a write found another state than the one read; read again."""


class Unresolved(Exception):
    """Internal: an earlier attempt here may have billed, and the task does not resend
    (``on_unknown="hold"``)."""

    def __init__(self, attempt: AttemptRef) -> None:
        super().__init__(attempt.key)
        self.attempt = attempt


class GrantUnanswered(Exception):
    """Internal: the ledger went away while granting a send: the grant of ``key`` (of
    operation ``operation_id``) may have committed, and nothing was sent under it."""

    def __init__(self, cause: LedgerUnavailable, operation_id: int | None, key: str | None):
        super().__init__(str(cause))
        self.cause = cause
        self.operation_id = operation_id
        self.key = key


class CallPath:
    """The rules every call of a run is opened by (see the module)."""

    def __init__(self, ledger: CallLedger, options: DeliveryOptions, told: Told) -> None:
        self.ledger = ledger
        self.options = options
        self.told = told

    def admit(
        self,
        amount: int,
        site_of: Callable[[CallAdmission], CallSite],
        admission: Callable[[Callable[[CallAdmission], tuple[str, str] | None]], T],
        *,
        tell: bool = True,
        patience: float | None = None,
    ) -> T:
        """Run a call's admission (the ledger's ``admit`` for the main call,
        ``admit_call`` for a labelled one) with the one plan of what it may reserve at
        once. A refusal is told (with ``tell``); a lost answer raises GrantUnanswered,
        naming what it may have granted."""
        seen: list[tuple[int, str | None]] = []

        def plan(here: CallAdmission) -> tuple[str, str] | None:
            made = self._at_once(site_of(here), here)
            seen[:] = [(here.operation_id, None if made is None else made[0])]
            return made

        try:
            return self.waiting(lambda: admission(plan), patience, tell=tell)
        except (BudgetExceeded, BudgetFrozen) as exc:
            if tell:
                self.told.denied(exc, amount)
            raise
        except LedgerUnavailable as exc:
            operation_id, key = seen[0] if seen else (None, None)
            # 0: the plan of a first delivery, made before its operation had an id
            raise GrantUnanswered(exc, operation_id or None, key) from exc

    def waiting(
        self, admission: Callable[[], T], patience: float | None = None, *, tell: bool = True
    ) -> T:
        """``admission``, run again when the call's turn in its rate windows' line has
        come, while the wait, in wall time, stays within ``patience`` (default: the
        task's ``rate_wait_in_process``). Its turn is read again from the ledger as it
        waits (a read: it takes nothing), so whatever changes the windows meanwhile
        moves it. Past its patience, RateWindowFull is raised with the turn as it
        stands then (the message comes back after that wait, under the same key,
        taking nothing again). The wait is told to the hooks once (with ``tell``)."""
        most = self.options.rate_wait_in_process if patience is None else patience
        began = time.monotonic()
        told = False
        while True:
            try:
                return admission()
            except RateWindowFull as full:
                if tell and not told:
                    self.told.rate_waited(full)
                    told = True
                self._wait_turn(full, most - (time.monotonic() - began))

    def _wait_turn(self, full: RateWindowFull, left: float) -> None:
        """Wait in the process for the turn ``full`` told, reading it again every
        :data:`TURN_READ_SECONDS`; raise RateWindowFull, as the turn stands, when it
        is further off than ``left`` seconds."""
        wait = full.wait
        while wait > 0:
            if wait > left:
                raise dataclasses.replace(full, wait_ms=math.ceil(wait * 1000)) from None
            nap = min(wait, TURN_READ_SECONDS)
            began = time.monotonic()
            time.sleep(nap)
            left -= time.monotonic() - began
            turn = None if full.key is None else self.ledger.rate_turn(full.key)
            if turn is None:
                return  # not booked any more (dropped, or never): ask again
            wait = turn

    @staticmethod
    def _at_once(site: CallSite, here: CallAdmission) -> tuple[str, str] | None:
        """The attempt an admission reserves and grants itself, ``(key, reason)``:
        where nothing earlier is left to decide at the call's position (and no other
        call of the operation was left open)."""
        latest = here.latest
        if here.others_open or (latest is not None and latest.state != AttemptState.RELEASED):
            return None
        return site.key(here.count), site.reason(latest)

    def open(
        self, site: CallSite, here: CallAdmission, patience: float | None = None
    ) -> Opened | AnswerFound:
        """What the call's admission leaves to do: granted there already; or decided
        after what its position holds, then granted here. Raises Moved, Unresolved,
        GrantUnanswered, StepNotReplayable, or a refusal."""
        if here.reservation is not None:
            return self._granted(site, here.reservation)
        verdict = self._decide(site, here)
        if isinstance(verdict, AnswerFound):
            return verdict
        return self._send(site, here.operation_id, verdict, patience)

    def _decide(self, site: CallSite, here: CallAdmission) -> Send | AnswerFound:
        """The one rule for what a call's latest attempt leaves (its writes are
        compare-and-set; one that finds another state raises Moved)."""
        here = self._take_over(site, here)
        latest, count = here.latest, here.count
        if latest is None:
            return Send(site.key(count), site.reason(None))
        if latest.state == AttemptState.RESERVED:
            if latest.amount == site.ask.amount and site.ask.facts.rate is None:
                return Send(latest.key, latest.reason, reuse=True)  # never sent: as it is
            # (one with rate windows to take is made again: its grant takes them)
            self._release(latest, "never sent; re-estimated", AttemptState.RESERVED)
        elif latest.state == AttemptState.SETTLED:
            if latest.answer is not None:
                return AnswerFound(latest)
            if self._billed(site, latest) and not (
                self.options.rerun_billed or site.next_reason == "manual"
            ):
                # billed, its answer not kept: never sent again by an automatic retry
                raise StepNotReplayable(site.operation, latest.key)
        return Send(site.key(count), site.reason(latest))

    @staticmethod
    def _billed(site: CallSite, attempt: AttemptRef) -> bool:
        """Whether a call may have been billed under ``attempt`` (never under a main
        attempt of 0)."""
        return not nothing_sent_under(
            site.operation, site.ask.label, attempt.amount, attempt.recorded_actual
        )

    def _take_over(self, site: CallSite, here: CallAdmission) -> CallAdmission:
        """A new run takes over what an earlier one left open at the call (and, for
        the main call, in the rest of the operation): a main attempt of 0 is released
        (no call is ever sent under it); every attempt found sending is adopted as
        unknown; unless the task resends, an open one holds the operation
        (Unresolved)."""
        latest = here.latest
        if latest is not None and latest.state in OPEN:
            if not self._billed(site, latest):
                self._release(latest, "a dead run's main attempt of 0: nothing sent", latest.state)
                latest = replace(latest, state=AttemptState.RELEASED)
            else:
                self.adopt(latest)
                latest = replace(latest, state=AttemptState.UNKNOWN)
        for other in here.others_open:
            self.adopt(other)
        left = [a for a in (latest, *here.others_open) if a is not None and a.state in OPEN]
        if left and self.options.on_unknown != "resend":
            raise Unresolved(left[0])
        return replace(here, latest=latest)

    def adopt(self, attempt: AttemptRef) -> None:
        """A later delivery found ``attempt`` sending: its run is gone (the lease was
        not live), so its outcome is unknown. Moved if it moved meanwhile."""
        if attempt.state != AttemptState.SENDING:
            return
        try:
            if self.ledger.mark_unknown(
                attempt.key, "a later delivery found it sending: worker lost"
            ):
                self.told.unknown(attempt.key)
        except InvalidTransition:
            raise Moved(attempt.key) from None

    def _release(self, attempt: AttemptRef, why: str, expected: str) -> None:
        try:
            self.ledger.release(attempt.key, why, expected=expected)
        except InvalidTransition:
            raise Moved(attempt.key) from None

    def _send(
        self, site: CallSite, operation_id: int, verdict: Send, patience: float | None = None
    ) -> Opened:
        """Grant the send: a new attempt reserved, granted and described in one commit,
        or an attempt reserved before granted now."""
        ask = site.ask
        try:
            if verdict.reuse:
                self.ledger.mark_sending(verdict.key)
                return Opened(verdict.key, verdict.reason, described=False)
            reservation = self.waiting(
                lambda: self.ledger.reserve(
                    ask.budget,
                    verdict.key,
                    ask.amount,
                    fingerprint=ask.fingerprint,
                    reason=verdict.reason,
                    price_version=ask.price_version,
                    operation_id=operation_id,
                    label=ask.label,
                    step=ask.step,
                    grant=ask.facts,
                ),
                patience,
            )
        except InvalidTransition:
            raise Moved(verdict.key) from None
        except (BudgetExceeded, BudgetFrozen) as exc:
            self.told.denied(exc, ask.amount)
            raise
        except LedgerUnavailable as exc:
            raise GrantUnanswered(exc, operation_id, verdict.key) from exc
        return self._granted(site, reservation)

    def _granted(self, site: CallSite, reservation: Reservation) -> Opened:
        """A reservation that granted the call's send in its own commit."""
        if not reservation.created:
            raise Moved(reservation.key)  # the key was there: never a second permission
        self.told.admitted(site.ask.budget, reservation.key, site.ask.amount)
        return Opened(reservation.key, reservation.reason, described=True)
