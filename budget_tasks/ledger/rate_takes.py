"""Rate windows inside a transaction the caller holds: what a call's admission takes,
what its settlement gives back (see :mod:`.rates` for the rules; these are the
statement path's, and the server-side functions repeat them)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import RateAskTooLarge
from . import statements as sql
from .driver import Cursor
from .records import RATE_KINDS, RateAsk, RateClaim, RateSeen

#: One unit is this many of a window's level.
MILLI = 1000
#: How many minutes of its limit a window may owe to calls booked ahead.
OWED_MINUTES = 60


class RateShort(Exception):
    """Internal: a window of ``claim`` is short for attempt ``key`` (raised inside the
    admission's transaction, which rolls back); ``due_ms``: the key is booked and
    falls due then."""

    def __init__(self, claim: RateClaim, key: str, due_ms: int | None = None) -> None:
        super().__init__(key)
        self.claim = claim
        self.key = key
        self.due_ms = due_ms


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


def take_in(cur: Cursor, claim: RateClaim, key: str, now_ms: int) -> None:
    """Take ``claim`` for attempt ``key`` from its windows in the caller's transaction
    (all or none: a short window raises :class:`RateShort`, and the caller rolls
    back). A booking of ``key`` that has come due is taken instead; one not yet due
    raises :class:`RateShort` with its due time."""
    windows = claimed(cur, claim)
    if not windows:
        return
    ask = claim.ask
    for _, scope, kind, per_minute in windows:
        if ask.of(kind) > per_minute:
            raise RateAskTooLarge(claim.provider, scope, kind, ask.of(kind), per_minute)
    booked = cur.all(sql.RATE_TAKEN, {"key": key})
    if booked:
        due = due_of(booked)
        if due is not None:
            if due > now_ms:
                raise RateShort(claim, key, due)
            held = {int(window_id): int(taken) for window_id, taken, _ in booked}
            if all(held.get(w[0], -1) >= ask.of(w[2]) for w in windows):
                cur.run(sql.RATE_BOOKING_SENT, {"key": key})
                return
        # booked for another ask (or left by an attempt long gone): taken as any call's
        unbooked(cur, key, booked, now_ms)
    if not took(cur, windows, ask, now_ms, key, claim.own):
        raise RateShort(claim, key)


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
            cur.run(sql.RECORD_RATE_TAKE, {"key": key, **taken, "due_ms": None})
    return True


class Unbooked(Exception):
    """Internal: a booking would owe more than :data:`OWED_MINUTES` (raised inside its
    transaction, which rolls back); ``wait``: scope, kind and ms until it would not."""

    def __init__(self, wait: tuple[str, str, int]) -> None:
        super().__init__(wait)
        self.wait = wait


def book_in(cur: Cursor, claim: RateClaim, key: str, now_ms: int) -> tuple[str, str, int]:
    """Book ``claim`` ahead for attempt ``key`` (it was short), in the caller's
    transaction: each window takes it, going below 0 by what it lacks, at most
    :data:`OWED_MINUTES` of its limit; every part falls due with the window that keeps
    it longest, which is returned, ``(scope, kind, wait in ms)``. One that would owe
    more raises :class:`Unbooked`. A booking of ``key`` not yet due stands."""
    longest = (claim.scopes[0], "requests", 1)
    booked = cur.all(sql.RATE_TAKEN, {"key": key})
    due = due_of(booked)
    if due is not None and due > now_ms:
        return (claim.scopes[0], "requests", due - now_ms)  # booked meanwhile
    if booked:
        unbooked(cur, key, booked, now_ms)
    for window_id, scope, kind, per_minute in claimed(cur, claim):
        ask = claim.ask.of(kind) * MILLI
        params = {"id": window_id, "ask": ask, "now_ms": now_ms}
        row = cur.one(sql.BOOK_RATE, params)
        if row is None:
            found = cur.one(sql.RATE_LEVEL, params)
            if found is None:
                continue  # cleared since it was listed
            over = ask - (int(found[0]) + per_minute * OWED_MINUTES * 60 * MILLI)
            raise Unbooked((scope, kind, refill_ms(over, per_minute)))
        level = int(row[0])
        wait = refill_ms(-level, per_minute) if level < 0 else 1
        if wait > longest[2]:
            longest = (scope, kind, wait)
        taken = {"window_id": window_id, "taken": ask // MILLI, "own": scope in claim.own}
        cur.run(sql.RECORD_RATE_TAKE, {"key": key, **taken, "due_ms": now_ms})
    cur.run(sql.SET_RATE_DUE, {"key": key, "due_ms": now_ms + longest[2]})
    return longest


def due_of(booked: list[tuple[Any, ...]]) -> int | None:
    """When what a key booked falls due (None: nothing is booked under it, or what is
    there was taken, not booked)."""
    dues = [due for _, _, due in booked]
    if not dues or None in dues:
        return None
    return max(int(due) for due in dues)


def unbooked(cur: Cursor, key: str, booked: list[tuple[Any, ...]], now_ms: int) -> None:
    """Drop what ``key`` booked (or took, and its attempt never was: a stale row),
    giving it back whole: nothing was sent under it."""
    for window_id, taken, _ in booked:
        back = int(taken) * MILLI
        cur.run(sql.GIVE_RATE_BACK, {"id": window_id, "back": back, "now_ms": now_ms})
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
#: longest refusal's wait (what a window may owe), so their products stay in a BIGINT.
MOST_REMAINING = 10**12
MOST_WAIT_MS = OWED_MINUTES * 60 * 1000


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
