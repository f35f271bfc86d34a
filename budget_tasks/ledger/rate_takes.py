"""Rate windows inside a transaction the caller holds: what a call's admission takes,
where a call that finds no room waits its turn, what its settlement gives back (see
:mod:`.rates` for the rules; these are the statement path's, and the server-side
functions repeat the common case).

A window's ``level`` is what it holds now, net of every call booked on it; its
``booked`` is what those calls booked. A booked call's turn is not written down: it is
read from the window each time it is asked (:func:`turn_in`), so whatever changes the
window after the call was booked (a limit raised or lowered, what a provider's answer
says remains, a 429's retry-after, tokens a settlement gives back) moves every booked
call's turn with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import RateAskTooLarge
from . import statements as sql
from .driver import Cursor
from .records import RATE_KINDS, RateAsk, RateClaim, RateSeen

#: One unit is this many of a window's level.
MILLI = 1000
#: How many minutes of its limit a window's line of booked calls may owe.
BOOKED_MINUTES = 1440
#: A tenant's booking moves its place in a line by its ask times this, over its weight.
WEIGHT_SCALE = 1000
#: The weight of a tenant none was given (a budget's ``rate_weight``: 1 to 1000).
DEFAULT_WEIGHT = 1


@dataclass(frozen=True, slots=True)
class Turn:
    """When a booked call's turn comes: ``wait_ms`` from now (0: it has come), and the
    window that keeps it longest."""

    scope: str
    kind: str
    wait_ms: int


class RateShort(Exception):
    """Internal: a window of ``claim`` is short for attempt ``key`` (raised inside the
    admission's transaction, which rolls back); ``turn``: the key is booked, and its
    turn has not come; ``budgets``: the chain its money is held in (the first a tenant
    of its line)."""

    def __init__(
        self, claim: RateClaim, key: str, budgets: tuple[int, ...], turn: Turn | None = None
    ) -> None:
        super().__init__(key)
        self.claim = claim
        self.key = key
        self.budgets = budgets
        self.turn = turn


#: A rate window as a claim finds it: id, scope, kind, limit a minute.
Window = tuple[int, str, str, int]


def claimed(cur: Cursor, claim: RateClaim) -> list[Window]:
    """The windows ``claim`` takes from, ``(id, scope, kind, per_minute)`` in id
    order: its provider's, of its scopes, of the kinds it asks any of."""
    return [
        (int(window_id), scope, kind, int(per_minute))
        for window_id, scope, kind, per_minute in cur.all(
            sql.RATE_WINDOWS_OF_PROVIDER, {"provider": claim.provider}
        )
        if scope in claim.scopes and claim.ask.of(kind) > 0
    ]


def take_in(
    cur: Cursor, claim: RateClaim, key: str, now_ms: int, budgets: tuple[int, ...] = ()
) -> None:
    """Take ``claim`` for attempt ``key`` from its windows in the caller's transaction
    (all or none: a short window raises :class:`RateShort`, and the caller rolls
    back). A booking of ``key`` whose turn has come is sent instead; one whose turn has
    not raises :class:`RateShort` with its turn."""
    windows = claimed(cur, claim)
    if not windows:
        return
    ask = claim.ask
    for _, scope, kind, per_minute in windows:
        if ask.of(kind) > per_minute:
            raise RateAskTooLarge(claim.provider, scope, kind, ask.of(kind), per_minute)
    taken = cur.all(sql.RATE_TAKEN, {"key": key})
    if taken:
        if _booked_for(windows, ask, taken):
            _lock(cur, sorted(int(window_id) for window_id, _, _ in taken))
            turn = turn_in(cur, key, now_ms)
            if turn is not None and turn.wait_ms > 0:
                raise RateShort(claim, key, budgets, turn)
            sent_in(cur, key)
            return
        # booked for another ask, or left by an attempt never sent: dropped whole
        unbooked(cur, key, taken, now_ms)
    if not took(cur, windows, ask, now_ms, key, claim.own):
        raise RateShort(claim, key, budgets)


def took(
    cur: Cursor,
    windows: list[Window],
    ask: RateAsk,
    now_ms: int,
    key: str | None,
    own: tuple[str, ...] = (),
) -> bool:
    """Take ``ask`` from each of ``windows`` (compare-and-set, in id order), recording
    what ``key`` took; False where one is short (the caller rolls back what was
    taken)."""
    for window_id, scope, kind, _ in windows:
        params = {"id": window_id, "ask": ask.of(kind) * MILLI, "now_ms": now_ms}
        if cur.one(sql.TAKE_RATE, params) is None:
            if cur.one(sql.RATE_LEVEL, params) is None:
                continue  # cleared since it was listed: it holds nothing back
            return False
        if key is not None:
            taken = {"window_id": window_id, "taken": ask.of(kind), "own": scope in own}
            cur.run(sql.RECORD_RATE_TAKE, {"key": key, **taken})
    return True


class Unbooked(Exception):
    """Internal: a window's line already owes :data:`BOOKED_MINUTES` of its limit
    (raised inside the booking's transaction, which rolls back); ``turn``: how long
    until it would hold this call too."""

    def __init__(self, turn: Turn) -> None:
        super().__init__(turn)
        self.turn = turn


def book_in(
    cur: Cursor, claim: RateClaim, key: str, now_ms: int, budgets: tuple[int, ...] = ()
) -> Turn:
    """Book ``claim`` for attempt ``key`` in the line of each of its windows (it was
    short), in the caller's transaction, and say when its turn comes. A booking of
    ``key`` already made for this ask keeps its place; one for another ask is dropped,
    and the call joins the line anew.

    Each window's level goes below 0 by the ask (at most :data:`BOOKED_MINUTES` of its
    limit: :class:`Unbooked`), and the call takes its place in the window's line:
    after the calls its tenant booked there before, and never before the line's
    present (its virtual time), each tenant moving by its ask over its weight, so that
    tenants who keep asking share the window by their weights, in order of arrival
    within each."""
    taken = cur.all(sql.RATE_TAKEN, {"key": key})
    if _booked_for(claimed(cur, claim), claim.ask, taken):
        _lock(cur, sorted(int(window_id) for window_id, _, _ in taken))
        turn = turn_in(cur, key, now_ms)
        assert turn is not None
        cur.run(sql.SET_RATE_BACK, {"key": key, "back_ms": now_ms + turn.wait_ms})
        return turn
    if taken:
        # booked for another ask (the request changed), or left by an attempt never
        # sent: dropped whole, and the call joins the line anew
        unbooked(cur, key, taken, now_ms)
    share, weight = share_of(cur, budgets)
    for window_id, scope, kind, per_minute in claimed(cur, claim):
        units = claim.ask.of(kind)
        params = {"id": window_id, "ask": units * MILLI, "now_ms": now_ms}
        row = cur.one(sql.BOOK_RATE, params)
        if row is None:
            found = cur.one(sql.RATE_LEVEL, params)
            if found is None:
                continue  # cleared since it was listed
            most = per_minute * BOOKED_MINUTES * 60 * MILLI
            over = units * MILLI - most - int(found[0])
            raise Unbooked(Turn(scope, kind, refill_ms(over, per_minute)))
        vtime, arrival = int(row[0]), int(row[1])
        before = cur.one(sql.RATE_SHARE, {"id": window_id, "share": share})
        start = vtime if before is None else max(vtime, int(before[0]))
        finish = start - (-units * WEIGHT_SCALE // weight)  # rounded up
        cur.run(sql.SET_RATE_SHARE, {"id": window_id, "share": share, "finish": finish})
        cur.run(
            sql.RECORD_RATE_BOOKING,
            {
                "key": key,
                "window_id": window_id,
                "taken": units,
                "own": scope in claim.own,
                "tag": start,
                "arrival": arrival,
                "now_ms": now_ms,
            },
        )
    turn = turn_in(cur, key, now_ms)
    if turn is None:  # every window of the claim was cleared meanwhile
        return Turn(claim.scopes[0], "requests", 0)
    cur.run(sql.SET_RATE_BACK, {"key": key, "back_ms": now_ms + turn.wait_ms})
    return turn


def _booked_for(windows: list[Window], ask: RateAsk, taken: list[tuple[Any, ...]]) -> bool:
    """Whether ``taken`` is a booking of ``ask`` on every one of ``windows``."""
    held = {int(window_id): int(units) for window_id, units, back in taken if back is not None}
    return bool(held) and all(held.get(w[0]) == ask.of(w[2]) for w in windows)


def share_of(cur: Cursor, budgets: tuple[int, ...]) -> tuple[int, int]:
    """The tenant a call shares its windows as, and its weight: the nearest budget of
    its chain (its own first) that has a ``rate_weight``; else its own budget, at
    :data:`DEFAULT_WEIGHT` (0: a call with no budget)."""
    for budget_id in budgets:
        row = cur.one(sql.RATE_WEIGHT, {"id": budget_id})
        if row is not None and row[0] is not None:
            return budget_id, int(row[0])
    return (budgets[0] if budgets else 0), DEFAULT_WEIGHT


def turn_in(cur: Cursor, key: str, now_ms: int) -> Turn | None:
    """When the booking of ``key`` has its turn (None: nothing is booked under it):
    on each of its windows, once what the window holds for its line (its level
    refilled to now, plus all that is booked) covers the line up to and including
    this booking; the longest of its windows."""
    longest: Turn | None = None
    rows = cur.all(sql.RATE_TURN, {"key": key, "now_ms": now_ms})
    for _, scope, kind, per_minute, holds, ahead in rows:
        short = int(ahead or 0) * MILLI - int(holds)
        wait = refill_ms(short, int(per_minute)) if short > 0 else 0
        if longest is None or wait > longest.wait_ms:
            longest = Turn(scope, kind, wait)
    return longest


def sent_in(cur: Cursor, key: str) -> None:
    """The booking of ``key`` has had its turn and is sent: it leaves each line (what it
    booked stays owed by the level), and each window's virtual time reaches its
    place. The caller has locked the windows."""
    for window_id, units, tag in cur.all(sql.RATE_BOOKING, {"key": key}):
        params = {"id": window_id, "back": int(units) * MILLI, "tag": tag}
        cur.run(sql.RATE_BOOKING_SENT_FROM, params)
    cur.run(sql.RATE_BOOKING_SENT, {"key": key})


def _lock(cur: Cursor, window_ids: list[int]) -> None:
    for window_id in window_ids:  # in id order, as every writer locks them
        cur.run(sql.LOCK_RATE_WINDOW, {"id": window_id})


def unbooked(cur: Cursor, key: str, taken: list[tuple[Any, ...]], now_ms: int) -> None:
    """Drop what ``key`` booked (or took, and its attempt never was: a stale row),
    giving it back whole: nothing was sent under it."""
    for window_id, units, back_ms in taken:
        params = {"id": window_id, "back": int(units) * MILLI, "now_ms": now_ms}
        cur.run(sql.GIVE_RATE_BACK if back_ms is None else sql.UNBOOK_RATE, params)
    cur.run(sql.DROP_RATE_TAKES, {"key": key})


def refill_ms(thousandths: int, per_minute: int) -> int:
    """How many milliseconds ``per_minute`` takes to refill ``thousandths`` (at least
    1)."""
    return max(1, math.ceil(thousandths * 60 / per_minute))


def give_back_in(
    cur: Cursor, key: str, now_ms: int, counted: RateAsk | None, seen: RateSeen | None = None
) -> None:
    """What attempt ``key`` took goes back to its windows, in the caller's
    transaction: every token it took where ``counted`` is the vendor's count of the
    call (a request sent stays counted); where ``counted`` is None, nothing (its
    outcome is unknown: the vendor may have counted all of it). Then each window is
    narrowed to what the provider's answer said remains (``seen``)."""
    for window_id, taken, kind, own in cur.all(sql.RATE_TAKEN_KINDS, {"key": key}):
        if counted is not None and kind != "requests":
            back = max(0, int(taken) - counted.of(kind)) * MILLI
            if back:
                cur.run(sql.GIVE_RATE_BACK, {"id": window_id, "back": back, "now_ms": now_ms})
        told = narrowing(seen, kind, bool(own))
        if seen is not None and told is not None:
            remaining, wait_ms, limit = told
            params = {"id": window_id, "now_ms": now_ms, "at_ms": seen.at_ms, "own": bool(own)}
            cur.run(
                sql.NARROW_RATE,
                {**params, "remaining": remaining, "wait_ms": wait_ms, "limit": limit},
            )
    cur.run(sql.DROP_RATE_TAKES, {"key": key})


#: The most a provider's "remaining" is believed (a window's largest limit) and the
#: longest refusal's wait (an hour), so their products stay in a BIGINT.
MOST_REMAINING = 10**12
MOST_WAIT_MS = 60 * 60 * 1000


def narrowing(seen: RateSeen | None, kind: str, own: bool) -> tuple[int, int, int | None] | None:
    """What a window of ``kind`` is narrowed to, ``(remaining, wait in ms, limit)``:
    what the answer said remains of that kind (not said: no bound), owing the
    refusal's wait where nothing remains, and the limit it stated; None: the answer
    told this window nothing. The vendors state their limits per model: only the
    call's own model's windows (``own``) are narrowed so; a shared one (``*``, a
    group, a key) only by a refusal that named no limit at all."""
    if seen is None:
        return None
    remaining, limit = (seen.of(kind), seen.limit_of(kind)) if own else (None, None)
    if remaining is None and limit is None:
        told = any(seen.of(other) is not None for other in RATE_KINDS)
        if told or not seen.wait_ms:
            return None
        remaining = 0
    wait_ms = seen.wait_ms if remaining == 0 else 0
    remaining = MOST_REMAINING if remaining is None else min(remaining, MOST_REMAINING)
    limit = None if limit is None else min(limit, MOST_REMAINING)
    return remaining, min(wait_ms, MOST_WAIT_MS), limit


def abandoned_in(cur: Cursor, before_ms: int, now_ms: int) -> int:
    """Drop the bookings told to come back before ``before_ms`` that never did (the
    message lost, the budget refused it when it did): what they booked goes back to
    their windows (the calls behind them move up). How many calls' bookings went."""
    keys = [str(key) for (key,) in cur.all(sql.ABANDONED_RATE_BOOKINGS, {"before_ms": before_ms})]
    taken = {key: cur.all(sql.RATE_TAKEN, {"key": key}) for key in keys}
    _lock(cur, sorted({int(row[0]) for rows in taken.values() for row in rows}))
    for key, rows in taken.items():
        unbooked(cur, key, rows, now_ms)
    cur.run(sql.PURGE_RATE_SHARES, {})
    return len(keys)
