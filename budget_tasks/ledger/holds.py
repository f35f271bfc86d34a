"""Holds: reserve before a send, grant it, then settle, release or keep the hold open;
provider corrections as adjustments."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any

from .. import _validate as check
from ..errors import (
    InvalidTransition,
    RetentionRefused,
    UnknownAttempt,
    UnknownOperation,
)
from . import escrow, functions, partitions
from . import statements as sql
from .base import Chain, Found, LedgerBase, _ids, attempt_row, made_now
from .counters import _apply, _journal
from .driver import Cursor
from .periods import period_start
from .records import (
    CallAdmission,
    CallAsk,
    CallFacts,
    Reservation,
)
from .schema import (
    ATTEMPT_REASONS,
)


def _check_reservation(
    budget: str,
    key: str,
    amount: int,
    fingerprint: str | None,
    price_version: str | None,
    label: str | None,
    step: str | None,
    reason: str,
) -> None:
    check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
    check.key(key, "key")
    check.money(amount)
    check.optional_text(fingerprint, "fingerprint")
    check.optional_text(price_version, "price_version", max_length=64)
    check.optional_text(label, "label", max_length=100)
    check.optional_text(step, "step")
    if reason not in ATTEMPT_REASONS:
        raise ValueError(f"reason must be one of {ATTEMPT_REASONS}, not {reason!r}")


#: What a delivery says to make of a call's admission: the attempt to reserve and grant
#: in it, ``(attempt key, reason)``, or None where the caller has more to decide first.
CallPlan = Callable[[CallAdmission], "tuple[str, str] | None"]


def call_row(
    chain: Chain, call: CallAsk, planned: tuple[str, str], operation_id: int | None
) -> dict[str, Any]:
    """The attempt row a call's admission makes where ``planned`` names it (key,
    reason), the main call or a labelled one (see :func:`~.base.attempt_row`)."""
    key, reason = planned
    return attempt_row(
        chain,
        key,
        call.amount,
        reason,
        fingerprint=call.fingerprint,
        price_version=call.price_version,
        operation_id=operation_id,
        label=call.label,
        step=call.step,
    )


def attempt_params(
    chain: Chain, found: Found, row: dict[str, Any], facts: CallFacts | None, stamp: Any
) -> dict[str, Any]:
    """The attempt's part of :data:`.functions.ADMIT`: the row
    :meth:`~.base.LedgerBase._reserve_in` inserts (``row``: see
    :func:`~.base.attempt_row`), granted where ``facts`` say what the call is, and the
    periods it holds in (``found``)."""
    bound = None if facts is None else facts.bound
    stop = found.escrow
    return {
        "now": stamp,
        "a_key": row["key"],
        "budget_id": row["budget_id"],
        "period_id": found.periods[chain[0][0]][0],
        "a_fingerprint": row["fingerprint"],
        "reason": row["reason"],
        "amount": row["amount"],
        "price_version": row["price_version"],
        "operation_id": row["operation_id"],
        "label": row["label"],
        "step": row["step"],
        "granted": facts is not None,
        "lookup": None if facts is None else facts.lookup,
        "model": None if facts is None else facts.model,
        "timeout_ms": None if facts is None else facts.timeout_ms,
        "request_digest": None if facts is None else facts.request,
        "input_bound": None if bound is None else bound.input_tokens,
        "output_bound": None if bound is None else bound.output_tokens,
        "holds": _array(period_id for _, period_id in found.holds),
        "escrow_period": None if stop is None else found.periods[stop.budget_id][0],
        "escrow_chain": None if stop is None else _array(stop.chain_ids),
        "escrow_sources": (
            None if stop is None else _array(found.periods[b][0] for b, _, _ in stop.ancestors)
        ),
        # a draw is the function's where each ancestor's period contains the escrowed
        # one's (else this host admits in a period they left: the statements decide)
        "draw_share": (
            escrow.GRANT_SHARE if stop is not None and escrow.aligned(stop, found.periods) else None
        ),
    }


def _array(ids: Iterable[int]) -> str:
    """Ids as a PostgreSQL array literal, which the statement casts: cheaper to send
    than a list psycopg must inspect and dump on every admission."""
    return "{" + ",".join(str(int(i)) for i in ids) + "}"


class Holds(LedgerBase):
    """The hold methods of :class:`~budget_tasks.Ledger`."""

    def _admit_call_in(
        self,
        cur: Cursor,
        ask: CallAsk,
        found_here: CallAdmission,
        chain: Chain,
        found: Found,
        now: datetime,
        plan: CallPlan,
    ) -> CallAdmission:
        """The one admission of a call, the main call or a labelled one, in the
        caller's transaction: where ``plan`` names the attempt to make from what was
        found at the call's position, that attempt is reserved on the call's budget
        chain, granted its send and described, in this commit. A refusal raises (the
        caller rolls back)."""
        planned = plan(found_here)
        if planned is None:
            return found_here
        row = call_row(chain, ask, planned, found_here.operation_id)
        reservation = self._reserve_in(cur, chain, found, row, now, ask.facts)
        return replace(found_here, reservation=reservation)

    def _reserved_alone(
        self, chain: Chain, row: dict[str, Any], grant: CallFacts | None
    ) -> Reservation | None:
        """:meth:`reserve`'s common case as one function call (see :mod:`.functions`);
        None where it declined."""
        now = self.now()
        found = self._holds(chain, now)
        params = functions.admit_params(
            attempt_params(chain, found, row, grant, self._driver.ts(now))
        )
        if self._sent_alone(functions.ADMIT, params) is None:
            return None
        return made_now(self._owner(chain), found.periods[chain[0][0]][1], row, grant)

    def reserve(
        self,
        budget: str,
        key: str,
        amount: int,
        *,
        fingerprint: str | None = None,
        reason: str = "first",
        price_version: str | None = None,
        operation_id: int | None = None,
        label: str | None = None,
        step: str | None = None,
        grant: CallFacts | None = None,
    ) -> Reservation:
        """Hold ``amount`` on ``budget`` and every ancestor for the attempt ``key``.

        Admits only if ``spent + held + amount <= cap`` in the current period of each
        budget in the chain, each checked and written by one conditional UPDATE, in
        budget-id order, in one transaction. Permission to send exists once this
        returns with ``created=True``. An existing key returns its reservation with
        ``created=False``; another budget, amount or fingerprint raises
        IdempotencyConflict. ``reason`` says why the attempt exists (first, redelivery,
        rate_limited_retry, unknown_resend, manual); ``price_version`` records the price
        table the amount was estimated from. With ``grant`` (what the call is, possibly
        nothing: ``CallFacts()``), the send is granted in the same transaction: the
        attempt is ``sending`` and no ``mark_sending`` follows.
        """
        _check_reservation(budget, key, amount, fingerprint, price_version, label, step, reason)
        if operation_id is not None:
            check.row_id(operation_id, "operation_id")
        chain = self._admission_chain(budget)
        row = attempt_row(
            chain,
            key,
            amount,
            reason,
            fingerprint=fingerprint,
            price_version=price_version,
            operation_id=operation_id,
            label=label,
            step=step,
        )

        def admission(cur: Cursor, found: Found | None, now: datetime) -> Reservation:
            assert found is not None  # a chain has its periods
            return self._reserve_in(cur, chain, found, row, now, grant)

        try:
            if self._functions:
                alone = self._reserved_alone(chain, row, grant)
                if alone is not None:
                    return alone
            return self._admitting(chain, admission)
        except self._driver.integrity as exc:
            if operation_id is None:
                raise
            # the one reference the caller gives: an operation that does not exist
            raise UnknownOperation(f"id {operation_id}") from exc

    def mark_sending(
        self, key: str, *, provider: str | None = None, request_id: str | None = None
    ) -> None:
        """reserved -> sending. The one grant of a send: a second call raises."""
        check.text(key, "key")
        check.optional_text(provider, "provider", max_length=64)
        check.optional_text(request_id, "request_id")
        params = {
            "key": key,
            "now": self._driver.ts(self.now()),
            "provider": provider,
            "request_id": request_id,
        }
        with self._driver.transaction() as cur:
            if cur.one(sql.MARK_SENDING, params) is None:
                state = cur.one(sql.ATTEMPT_STATE, {"key": key})
                if state is None:
                    raise UnknownAttempt(key)
                raise InvalidTransition(key, state[0], "mark sending")

    def mark_unknown(
        self,
        key: str,
        reason: str,
        *,
        recorded_actual: int | None = None,
        request_id: str | None = None,
        response_id: str | None = None,
    ) -> bool:
        """sending -> unknown: the outcome is unknown and the hold stays.

        ``recorded_actual`` is usage the run recorded before the outcome became unknown
        (proof of billing: the attempt is never resolved below it); the call's request
        and response ids, where it reported them, are kept for reconciliation. Returns
        False if the attempt was already unknown; raises InvalidTransition from any
        other state.
        """
        check.text(key, "key")
        check.text(reason, "reason", max_length=10_000)
        if recorded_actual is not None:
            check.money(recorded_actual, "recorded_actual")
        ids = _ids(request_id, response_id)
        with self._driver.transaction() as cur:
            changed = self._mark_unknown_in(cur, key, reason, recorded_actual, ids)
        return changed

    def record_call(
        self,
        key: str,
        *,
        request_id: str | None = None,
        response_id: str | None = None,
        cost: int | None = None,
    ) -> None:
        """Record what a finished call reported, at once and in one statement: its
        request and response ids and its priced usage, added to the attempt's recorded
        usage (a recorded actual is proof of billing: the attempt is never released, and
        never settled below it)."""
        check.text(key, "key")
        check.optional_text(request_id, "request_id")
        check.optional_text(response_id, "response_id")
        if cost is not None:
            check.money(cost, "cost")
        params = {"key": key, "request_id": request_id, "response_id": response_id, "cost": cost}
        with self._driver.transaction() as cur:
            if cur.one(sql.RECORD_CALL, params) is not None:
                return
            state = cur.one(sql.ATTEMPT_STATE, {"key": key})
        if state is None:
            raise UnknownAttempt(key)
        raise InvalidTransition(key, state[0], "record a call's outcome")

    def record_request_id(self, key: str, request_id: str) -> None:
        """Store the provider's request id (as soon as it is known, for reconciliation)."""
        check.text(key, "key")
        check.text(request_id, "request_id")
        with self._driver.transaction() as cur:
            if cur.one(sql.RECORD_REQUEST_ID, {"key": key, "request_id": request_id}):
                return
            row = cur.one(sql.ATTEMPT_REQUEST_ID, {"key": key})
        if row is None:
            raise UnknownAttempt(key)
        state, recorded = row
        if recorded == request_id:
            return
        if recorded is not None:
            raise InvalidTransition(
                key, state, f"replace request id {recorded!r} by {request_id!r}"
            )
        raise InvalidTransition(key, state, "record a request id before sending")

    def settle(
        self,
        key: str,
        actual: int,
        *,
        estimate_only: bool = False,
        note: str | None = None,
        expected: str | None = None,
        request_id: str | None = None,
        response_id: str | None = None,
    ) -> bool:
        """Replace the hold by the actual charge: ``held -= reserved; spent += actual``.

        True if applied; False if already settled with this actual. Another actual
        raises SettlementConflict. An actual above the reservation is recorded as it
        is and logged as an overrun; one below the usage the run recorded raises
        UsageRecorded. ``note`` goes into the journal entry (an operator's resolution
        says so there). With ``expected``, only from that state (compare-and-set: the
        state the caller read); another raises InvalidTransition. The call's request and
        response ids, where given, are written with it.
        """
        check.text(key, "key")
        check.money(actual, "actual")
        check.optional_text(note, "note", max_length=10_000)
        ids = _ids(request_id, response_id)
        if self._functions and expected in (None, "sending"):
            stamp = self._driver.ts(self.now())
            if self._settled_alone(
                key, actual, stamp, estimate_only=estimate_only, note=note, ids=ids
            ):
                return True
        applied, amount = self._resolve(
            key,
            actual,
            "settled",
            "charge",
            note,
            estimate_only=estimate_only,
            expected=expected,
            ids=ids,
        )
        if applied and actual > amount:
            self._log_overrun(key, amount, actual)
        return applied

    def release(self, key: str, reason: str, *, expected: str | None = None) -> bool:
        """Drop the hold without a charge (settle at 0). False if already released.

        Refused (UsageRecorded) for an attempt whose run recorded usage: a recorded
        actual is proof of billing."""
        check.text(key, "key")
        check.text(reason, "reason", max_length=10_000)
        return self._resolve(key, 0, "released", "release", reason, expected=expected)[0]

    def _refuse_if_archived(self, cur: Cursor, key: str, attempt_id: int) -> None:
        """A correction is refused where one of the attempt's periods (its budget's and
        each ancestor's at its admission) lies in a month retention archived: that
        period's rows are gone, and a correction of only the others would leave the
        archived one short without a trace."""
        archived = {self._driver.from_ts(row[1]) for row in cur.all(sql.ARCHIVES, {})}
        if not archived:
            return
        found = cur.one(sql.ATTEMPT_ADMITTED, {"attempt_id": attempt_id})
        assert found is not None  # locked above
        budget, admitted = found[0], self._driver.from_ts(found[1])
        for _, name, kind in self._chain(str(budget)):
            if kind == "none":
                continue  # its one period's rows are never archived
            month = partitions.month_start(period_start(kind, admitted))  # type: ignore[arg-type]
            if month in archived:
                raise RetentionRefused(
                    f"attempt {key!r} holds in a period of budget {name!r} in "
                    f"{month:%Y-%m}, a month retention archived: a correction is refused"
                )

    def adjust(
        self, key: str, delta: int, reason: str, *, ref: str | None = None, actor: str | None = None
    ) -> bool:
        """Add a provider correction to a settled or released attempt's charge.

        Recorded as a new journal entry, never an overwrite, in the attempt's own
        periods, naming ``actor`` (default: the OS user and host). ``ref`` (e.g. the
        provider's invoice line id) makes the correction idempotent: a second call with
        the same ref returns False. Refused (RetentionRefused) where one of its periods
        lies in a month that retention archived.
        """
        actor = check.actor(actor)
        check.text(key, "key")
        check.money(delta, "delta", signed=True)
        check.text(reason, "reason", max_length=10_000)
        check.optional_text(ref, "ref")
        if delta == 0:
            raise ValueError("an adjustment of 0 records nothing")
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            rows = cur.all(sql.LOCK_ATTEMPT, {"key": key})
            if not rows:
                raise UnknownAttempt(key)
            attempt_id, _, _, state, _, _ = rows[0]
            if state not in ("settled", "released"):
                raise InvalidTransition(key, state, "adjust before settlement")
            if ref is not None and cur.one(
                sql.ADJUSTMENT_SEEN, {"attempt_id": attempt_id, "ref": ref}
            ):
                return False
            self._refuse_if_archived(cur, key, attempt_id)
            (charged,) = cur.one(sql.ATTEMPT_CHARGED, {"attempt_id": attempt_id}) or (0,)
            if charged + delta < 0:
                raise ValueError(
                    f"adjustment {delta} would take attempt {key!r} below zero (charged {charged})"
                )
            for *_, period_id in rows:
                _journal(
                    cur, attempt_id, period_id, "adjustment", 0, delta, reason, stamp, ref, actor
                )
                _apply(cur, sql.APPLY_ADJUSTMENT, {"delta": delta, "period_id": period_id}, stamp)
        return True
