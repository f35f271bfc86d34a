"""A provider's rate limits held across the fleet: per provider and scope (a model, a
group of models sharing a quota, an API key), one token bucket per kind of limit
(requests, tokens, input or output tokens per minute), refilled continuously, in the
ledger's database, so that every worker on every host takes from the same ones.

A call takes what it may use from every window of its scope, all or none, in one
transaction (each window by a compare-and-set UPDATE, in id order: the order every
writer locks them in); settlement gives back what it did not use (tokens: a request
sent stays counted). A refusal says which limit keeps the ask out longest and how long
until every window holds it (None: never, the ask is more than a limit). Levels are
kept in thousandths of a unit, so that a refill of a fraction of a token is not lost.

A window holds a minute's worth and refills continuously (as Anthropic documents its
limits): after a quiet minute a burst may take the whole window and then what refills,
up to twice the limit in one rolling minute, never more.

A call whose facts carry a :class:`~.records.RateClaim` takes from its windows in the
transaction that admits its money (:func:`~.rate_takes.take_in`, called by the
admission), so both have room or neither is taken. A window without room puts the call
in its line instead (:func:`~.rate_takes.book_in`): the window goes below 0 by its ask
(net of everything booked, at most a day of its limit) and the call is told when its
turn comes (:class:`~budget_tasks.errors.RateWindowFull`); it comes back under the same
attempt key and sends without taking again. Its turn is read from the window whenever it
asks (:func:`~.rate_takes.turn_in`): it comes once what the window holds for its line
covers every call ahead of it and its own, so a raised or lowered limit, what a
provider's answer says remains, a 429's retry-after and tokens given back move every
waiting call. Within a tenant calls keep their order of arrival; tenants who keep
asking share a window by their budgets' ``rate_weight``. Settlement gives back the
tokens the vendor did not count (:func:`~.rate_takes.give_back_in`); a release gives
back every token, an unknown outcome none.

``ledger.rates`` (:class:`RateLimits`) is the operator's: set, clear, list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from .. import _validate as check
from . import statements as sql
from .budgets import set_rate_weight
from .driver import Cursor
from .rate_takes import MILLI, Window, claimed, refill_ms, took
from .records import RATE_KINDS, RateAsk, RateClaim
from .store import Store

__all__ = ["RateAsk", "RateClaim", "RateLimits", "RateTaken", "RateWindow"]

#: The largest limit a minute (its level in thousandths, refilled for up to two days,
#: stays inside a BIGINT).
MOST_PER_MINUTE = 10**10


@dataclass(frozen=True, slots=True)
class RateTaken:
    """A take's answer: granted, or which limit was short and how long until it holds
    the ask (None: never: the ask is more than the limit)."""

    granted: bool
    short: str | None = None
    wait: timedelta | None = None


@dataclass(frozen=True, slots=True)
class RateWindow:
    """One window as the operator sees it: its limit a minute and what it holds now."""

    provider: str
    scope: str
    kind: str
    per_minute: int
    #: what it holds now (below 0: what it owes the calls booked ahead)
    available: float
    #: calls booked ahead on it, waiting for their turn
    booked: int = 0


class _Short(Exception):
    def __init__(self, taken: RateTaken) -> None:
        self.taken = taken


def _now_ms(store: Store) -> int:
    return math.floor(store.now().timestamp() * 1000)


def _checked(provider: str, scope: str) -> None:
    check.text(provider, "provider", max_length=64)
    check.text(scope, "rate scope", max_length=100)


def set_limit(store: Store, provider: str, scope: str, kind: str, per_minute: int) -> None:
    """Hold ``provider``'s ``scope`` to ``per_minute`` of ``kind``: a new window starts
    full; a changed one keeps what it holds, never more than its new limit."""
    _checked(provider, scope)
    if kind not in RATE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(RATE_KINDS)}, not {kind!r}")
    if check.count(per_minute, "per_minute") == 0:
        raise ValueError("a limit of 0 a minute would admit nothing: clear it instead")
    if per_minute > MOST_PER_MINUTE:
        raise ValueError(f"a limit a minute is at most {MOST_PER_MINUTE:,}, not {per_minute:,}")
    params = {
        "provider": provider,
        "scope": scope,
        "kind": kind,
        "per_minute": per_minute,
        "now_ms": _now_ms(store),
    }
    with store.driver.transaction() as cur:
        cur.run(sql.SET_RATE_LIMIT, params)


def clear_limit(store: Store, provider: str, scope: str, kind: str | None = None) -> int:
    """Stop holding ``scope`` to ``kind`` (None: to any); how many windows went."""
    _checked(provider, scope)
    with store.driver.transaction() as cur:
        gone = [
            window_id
            for window_id, of in cur.all(
                sql.RATE_WINDOWS_OF, {"provider": provider, "scope": scope}
            )
            if kind is None or of == kind
        ]
        for window_id in gone:  # in id order, as every writer locks them
            cur.run(sql.CLEAR_RATE_WINDOW, {"id": window_id})
            cur.run(sql.CLEAR_RATE_SHARES, {"id": window_id})
    return len(gone)


def take(store: Store, provider: str, scope: str, ask: RateAsk) -> RateTaken:
    """Take ``ask`` from every window of ``scope``, all or none (see the module)."""
    _checked(provider, scope)
    now_ms = _now_ms(store)
    try:
        with store.driver.transaction() as cur:
            windows = claimed(cur, RateClaim(provider, (scope,), ask))
            if not took(cur, windows, ask, now_ms, None):
                raise _Short(_refusal(cur, windows, ask, now_ms))
    except _Short as short:  # raised inside the transaction: what it took rolled back
        return short.taken
    return RateTaken(True)


def _refusal(cur: Cursor, windows: list[Window], ask: RateAsk, now_ms: int) -> RateTaken:
    """The limit that keeps ``ask`` out longest, and how long until every window holds
    it (None: one never will), read in the refused transaction."""
    worst: tuple[str, int] | None = None
    for window_id, _, kind, _ in windows:
        found = cur.one(sql.RATE_LEVEL, {"id": window_id, "now_ms": now_ms})
        if found is None:
            continue
        level, per_minute = int(found[0]), int(found[1])
        wanted = ask.of(kind) * MILLI
        if wanted > per_minute * MILLI:
            return RateTaken(False, kind, None)
        if wanted > level:
            wait = refill_ms(wanted - level, per_minute)
            if worst is None or wait > worst[1]:
                worst = (kind, wait)
    if worst is None:  # freed meanwhile (a give-back): try again in a millisecond
        return RateTaken(False, None, timedelta(milliseconds=1))
    return RateTaken(False, worst[0], timedelta(milliseconds=worst[1]))


def give_back(
    store: Store,
    provider: str,
    scope: str,
    *,
    tokens: int = 0,
    input_tokens: int = 0,
    output_tokens: int = 0,
) -> None:
    """Give the tokens a call took and did not use back to ``scope``'s windows, never
    past their limits (a request sent stays counted)."""
    _checked(provider, scope)
    unused = RateAsk(0, tokens, input_tokens, output_tokens)
    now_ms = _now_ms(store)
    with store.driver.transaction() as cur:
        for window_id, kind in cur.all(sql.RATE_WINDOWS_OF, {"provider": provider, "scope": scope}):
            back = unused.of(kind) * MILLI
            if back:
                cur.run(sql.GIVE_RATE_BACK, {"id": window_id, "back": back, "now_ms": now_ms})


def windows(store: Store) -> list[RateWindow]:
    """Every window, with what it holds now."""
    with store.driver.transaction() as cur:
        rows = cur.all(sql.RATE_WINDOWS, {"now_ms": _now_ms(store)})
    return [
        RateWindow(provider, scope, kind, int(per_minute), int(level) / MILLI, int(booked))
        for provider, scope, kind, per_minute, level, booked in rows
    ]


class RateLimits:
    """The providers' rate limits held across the fleet (``ledger.rates``): set and
    cleared by the operator, taken and given back by the calls, listed for the views."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def set_limit(self, provider: str, scope: str, kind: str, per_minute: int) -> None:
        """Hold ``provider``'s ``scope`` (a model, a group of models, an API key) to
        ``per_minute`` of ``kind`` (requests, tokens, input or output tokens)."""
        set_limit(self._store, provider, scope, kind, per_minute)

    def clear_limit(self, provider: str, scope: str, kind: str | None = None) -> int:
        """Stop holding ``scope`` to ``kind`` (None: to any); how many limits went."""
        return clear_limit(self._store, provider, scope, kind)

    def take(self, provider: str, scope: str, ask: RateAsk) -> RateTaken:
        """Take ``ask`` from every window of ``scope``, all or none."""
        return take(self._store, provider, scope, ask)

    def give_back(
        self,
        provider: str,
        scope: str,
        *,
        tokens: int = 0,
        input_tokens: int = 0,
        output_tokens: int = 0,
    ) -> None:
        """Give the tokens a call took and did not use back (the request stays counted)."""
        give_back(
            self._store,
            provider,
            scope,
            tokens=tokens,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
        )

    def windows(self) -> list[RateWindow]:
        """Every limit set, with what it holds now."""
        return windows(self._store)

    def set_weight(self, budget: str, weight: int | None) -> None:
        """Make ``budget`` a tenant of the rate windows its calls share, at ``weight``
        (1 to 1000; None: none of its own). Where tenants' calls wait in one window's
        line, each gets its weight's part of the window while the others wait (an idle
        tenant's part goes to the rest); a budget under it with no weight of its own
        is part of it, and a budget with none anywhere above is a tenant at weight 1.
        Counts from the next call to wait."""
        set_rate_weight(self._store, budget, weight)
