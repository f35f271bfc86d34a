"""Holds: a call's admission (reserve, grant and describe in one commit), a release or
an unknown outcome, and the check a correction passes; functions over the store that
:class:`.CallLedger`, :class:`.Upkeep` and the operator's :class:`.Ledger` share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any

from .. import _validate as check
from ..errors import (
    RetentionRefused,
)
from . import escrow, functions, partitions
from . import statements as sql
from .driver import Cursor
from .periods import period_start
from .records import (
    Answered,
    CallAdmission,
    CallAsk,
    CallFacts,
    RateClaim,
    RateSeen,
    Reservation,
)
from .states import ATTEMPT_REASONS
from .store import Chain, HoldPlan, Store, attempt_row, epoch_ms, made_now


def check_reservation(
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
    reason), the main call or a labelled one (see :func:`.store.attempt_row`)."""
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
    chain: Chain, found: HoldPlan, row: dict[str, Any], facts: CallFacts | None, stamp: Any
) -> dict[str, Any]:
    """The attempt's part of :data:`.functions.ADMIT`: the row
    :meth:`.Store.reserve_in` inserts (``row``: see
    :func:`.store.attempt_row`), granted where ``facts`` say what the call is, and the
    periods it holds in (``found``)."""
    bound = None if facts is None else facts.bound
    stop = found.escrow
    rate = None if facts is None else facts.rate
    return {
        **_rate_params(rate),
        # the functions run on PostgreSQL, where a stamp is the aware datetime
        "now_ms": epoch_ms(stamp),
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


def _rate_params(rate: RateClaim | None) -> dict[str, Any]:
    """The rate claim's part of :data:`.functions.ADMIT` (``r_provider`` None: none)."""
    if rate is None:
        return {"r_provider": None}
    ask = rate.ask
    return {
        "r_provider": rate.provider,
        # the scopes as a PostgreSQL array literal, each quoted (a scope is any text)
        "r_scopes": "{" + ",".join(_quoted(scope) for scope in rate.scopes) + "}",
        "r_own": "{" + ",".join(_quoted(scope) for scope in rate.own) + "}",
        "r_requests": ask.requests,
        "r_tokens": ask.tokens,
        "r_input_tokens": ask.input_tokens,
        "r_output_tokens": ask.output_tokens,
    }


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _array(ids: Iterable[int]) -> str:
    """Ids as a PostgreSQL array literal, which the statement casts: cheaper to send
    than a list psycopg must inspect and dump on every admission."""
    return "{" + ",".join(str(int(i)) for i in ids) + "}"


def admit_call_in(
    store: Store,
    cur: Cursor,
    ask: CallAsk,
    found_here: CallAdmission,
    chain: Chain,
    found: HoldPlan,
    now: datetime,
    plan: CallPlan,
    before_money: Callable[[], None] | None = None,
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
    reservation = store.reserve_in(cur, chain, found, row, now, ask.facts, before_money)
    return replace(found_here, reservation=reservation)


def reserved_alone(
    store: Store, chain: Chain, row: dict[str, Any], grant: CallFacts | None
) -> Reservation | None:
    """:meth:`reserve`'s common case as one function call (see :mod:`.functions`);
    None where it declined."""
    now = store.now()
    found = store.find_holds(chain, now)
    params = functions.admit_params(attempt_params(chain, found, row, grant, store.driver.ts(now)))
    if store.sent_alone(functions.ADMIT, params) is None:
        return None
    return made_now(store.owner_of(chain), found.periods[chain[0][0]][1], row, grant)


def mark_unknown(
    store: Store,
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
    answered = Answered(request_id, response_id)
    with store.driver.transaction() as cur:
        changed = store.mark_unknown_in(cur, key, reason, recorded_actual, answered)
    return changed


def release(
    store: Store,
    key: str,
    reason: str,
    *,
    expected: str | None = None,
    seen: RateSeen | None = None,
) -> bool:
    """Drop the hold without a charge (settle at 0). False if already released.
    ``seen``: what the refusal said of the provider's rate limits (a 429's
    retry-after), which narrows the call's rate windows in the same commit.

    Refused (UsageRecorded) for an attempt whose run recorded usage: a recorded
    actual is proof of billing."""
    check.text(key, "key")
    check.text(reason, "reason", max_length=10_000)
    answered = Answered(seen=seen)
    return store.resolve(
        key, 0, "released", "release", reason, expected=expected, answered=answered
    )[0]


def refuse_if_archived(store: Store, cur: Cursor, key: str, attempt_id: int) -> None:
    """A correction is refused where one of the attempt's periods (its budget's and
    each ancestor's at its admission) lies in a month retention archived: that
    period's rows are gone, and a correction of only the others would leave the
    archived one short without a trace."""
    archived = {store.driver.from_ts(row[1]) for row in cur.all(sql.ARCHIVES, {})}
    if not archived:
        return
    found = cur.one(sql.ATTEMPT_ADMITTED, {"attempt_id": attempt_id})
    assert found is not None  # locked above
    budget, admitted = found[0], store.driver.from_ts(found[1])
    for _, name, kind in store.chain(str(budget)):
        if kind == "none":
            continue  # its one period's rows are never archived
        month = partitions.month_start(period_start(kind, admitted))  # type: ignore[arg-type]
        if month in archived:
            raise RetentionRefused(
                f"attempt {key!r} holds in a period of budget {name!r} in "
                f"{month:%Y-%m}, a month retention archived: a correction is refused"
            )
