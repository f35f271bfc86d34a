"""The ledger's money rules as one small reference model, in plain Python.

The specification in code of what every view of the real ledger (``budget_tasks.ledger``,
PostgreSQL and SQLite) must show: a stateful test drives both with the same operations
and compares. No database, no concurrency, no performance devices: escrow and slices are
checked where they limit a budget's shape, and are otherwise invisible, as in money.
Names and arguments follow the real ledger; amounts are ints of minor units; time is the
model's own clock (``advance``), UTC. Each rule is one method whose docstring names it.

The journal here is rolled up: each hold, charge, release and adjustment writes a row in
every period the attempt holds in (its budget's and each ancestor's). The real journal
has a row per period row it changes (slices, escrow): compare sums per budget and period.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime

from budget_tasks.ledger.periods import (
    DEFAULT_ROLLOVER_MULTIPLE,
    Renewal,
    next_period_start,
    period_start,
    previous_period_start,
)
from budget_tasks.ledger.periods import Period as Kind
from budget_tasks.ledger.records import RateSeen

PERIODS = ("none", "day", "week", "month")
RENEWALS = ("reset", "rollover")
HOLDING = ("reserved", "sending", "unknown")
MAX_MONEY = 10**15
MAX_SLICES = 64
START = datetime(2026, 1, 1, tzinfo=UTC)


class ModelError(Exception):
    """A refusal by the model, named like the real ledger's error (budget_tasks.errors)."""


class UnknownBudget(ModelError): ...


class BudgetExists(ModelError): ...


class BudgetExceeded(ModelError): ...


class BudgetFrozen(ModelError): ...


class CapBelowCommitted(ModelError): ...


class UnknownAttempt(ModelError): ...


class IdempotencyConflict(ModelError): ...


class InvalidTransition(ModelError): ...


class SettlementConflict(ModelError): ...


class UnknownOperation(ModelError): ...


class CannotReopen(ModelError): ...


class OperationFailed(ModelError): ...


class OperationInProgress(ModelError): ...


class RateWindowFull(ModelError):
    """A rate window had no room: the call was booked (or was already) ``wait_ms``
    ahead; ``scope`` and ``kind`` name the window that keeps it longest."""

    def __init__(self, scope: str, kind: str, wait_ms: int) -> None:
        super().__init__(scope, kind, wait_ms)
        self.scope, self.kind, self.wait_ms = scope, kind, wait_ms


class RateAskTooLarge(ModelError): ...


def money(value: object, name: str = "amount") -> int:
    """Rule (money): an amount is an int of minor units, from 0 to MAX_MONEY; bool and
    float are refused (TypeError), negatives and amounts too large (ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int of minor units, not {value!r}")
    if not 0 <= value <= MAX_MONEY:
        raise ValueError(f"{name} {value} is out of range")
    return value


def contains(outer: str, inner: str) -> bool:
    """Rule (nesting): a period of kind ``outer`` contains each period of kind ``inner``
    when it is ``none``, of the same kind, or when ``inner`` is ``day`` (a week can
    straddle two months, so ``month`` does not contain ``week``)."""
    return outer in ("none", inner) or inner == "day"


@dataclass
class Budget:
    name: str
    allowance: int  # the real BudgetInfo.cap: what each new period opens with
    period: Kind
    parent: str | None
    renewal: Renewal
    ceiling: int | None  # an explicit rollover ceiling
    escrow: bool
    slices: int
    frozen: bool = False
    #: its weight in the rate windows its calls share (None: none of its own)
    rate_weight: int | None = None


@dataclass
class Period:
    budget: str
    start: datetime
    cap: int
    closed: bool = False
    carried_out: int = 0


@dataclass
class Attempt:
    key: str
    budget: str
    amount: int
    periods: dict[str, datetime]  # each budget of the chain -> the period it holds in
    reason: str = "first"
    operation: str | None = None
    state: str = "reserved"
    actual: int | None = None
    adjustments: list[tuple[str | None, int]] = field(default_factory=list)

    @property
    def held(self) -> int:
        return self.amount if self.state in HOLDING else 0

    @property
    def spent(self) -> int:
        return (self.actual or 0) + sum(delta for _, delta in self.adjustments)

    @property
    def overrun(self) -> int:
        return max(0, (self.actual or 0) - self.amount) if self.state == "settled" else 0


@dataclass(frozen=True)
class Balance:
    budget: str
    cap: int
    spent: int
    held: int
    available: int
    period_start: datetime


@dataclass(frozen=True)
class BudgetReport(Balance):
    frozen: bool
    overrun: int


@dataclass(frozen=True)
class Hold:
    key: str
    budget: str
    amount: int
    state: str
    period_start: datetime


@dataclass(frozen=True)
class Entry:
    kind: str
    budget: str
    period_start: datetime
    attempt: str | None
    held: int = 0
    spent: int = 0
    cap: int = 0


@dataclass
class Operation:
    key: str
    status: str = "pending"  # pending, running, succeeded, failed, retryable (reopened)
    next_reason: str = "first"
    refusal: str | None = None
    attempts: list[str] = field(default_factory=list)


@dataclass
class RateWindow:
    """A provider's rate limit for a scope: a bucket of ``per_minute`` (in thousandths,
    ``level``) refilled continuously as of ``refilled_ms``; below 0 by what is booked
    in its line (``booked``) and by a 429's retry-after. ``vtime``: the line's present
    (the place of its last booking sent); ``arrivals``: how many calls joined it."""

    id: int
    provider: str
    scope: str
    kind: str
    per_minute: int
    level: int
    refilled_ms: int
    booked: int = 0
    vtime: int = 0
    arrivals: int = 0


@dataclass(frozen=True)
class RateTake:
    """What a key took from a window (units); booked in its line where ``back_ms`` is
    set: at virtual time ``tag``, arrival ``arrival``."""

    taken: int
    own: bool
    back_ms: int | None = None
    tag: int = 0
    arrival: int = 0


#: How many minutes of its limit a window's line of booked calls may owe, and a window
#: in all (its line and a 429's retry-after on top).
BOOKED_MINUTES = 1440
OWED_MINUTES = 2880
#: The longest a window's refill is counted for (what fills it from the most it owes).
REFILL_MOST_MS = 2881 * 60_000
#: A tenant's booking moves its place in a line by its ask times this over its weight.
WEIGHT_SCALE = 1000


def _refill_ms(thousandths: int, per_minute: int) -> int:
    return max(1, -(-thousandths * 60 // per_minute))


Takes = dict[str, dict[int, RateTake]]
#: What the rate windows' state is saved as, to undo a transaction that rolled back.
Saved = tuple[dict[int, RateWindow], Takes, dict[tuple[int, str], int]]


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


class RateRules:
    """The rules of the providers' rate windows, over a :class:`LedgerModel`'s clock
    and state (a mixin of its methods, kept apart for reading)."""

    now: datetime
    windows: dict[tuple[str, str, str], RateWindow]
    rate_takes: Takes
    #: each tenant's place in each window's line: where its last booking ends
    rate_shares: dict[tuple[int, str], int]
    _window_ids: int

    def tenant_of(self, budget: str) -> tuple[str, int]:
        """Rule (tenants): a call shares its windows as the nearest budget of its
        chain (its own first) that has a rate weight, else as its own at weight 1."""
        raise NotImplementedError

    def _level(self, w: RateWindow) -> int:
        """Rule (refill): per_minute a minute, continuously, never past per_minute, for
        no time backwards and at most the time that fills it from the most owed."""
        now = _ms(self.now)
        elapsed = 0 if now <= w.refilled_ms else min(now - w.refilled_ms, REFILL_MOST_MS)
        return min(w.per_minute * 1000, w.level + w.per_minute * elapsed // 60)

    def _set_level(self, w: RateWindow, level: int) -> None:
        w.level, w.refilled_ms = level, max(w.refilled_ms, _ms(self.now))

    def set_limit(self, provider: str, scope: str, kind: str, per_minute: int) -> None:
        """Rule (a limit): a new window starts full; a changed one keeps what it held,
        refilled at its old rate, never more than its new limit nor owing more than
        two days of it. Its booked calls keep their places (their turns follow)."""
        w = self.windows.get((provider, scope, kind))
        if w is None:
            self._window_ids += 1
            self.windows[(provider, scope, kind)] = RateWindow(
                self._window_ids,
                provider,
                scope,
                kind,
                per_minute,
                per_minute * 1000,
                _ms(self.now),
            )
            return
        level = min(self._level(w), per_minute * 1000)
        level = max(level, -per_minute * OWED_MINUTES * 60 * 1000)
        w.per_minute = per_minute
        self._set_level(w, level)

    def _claimed(
        self, provider: str, scopes: tuple[str, ...], ask: dict[str, int]
    ) -> list[RateWindow]:
        return sorted(
            (
                w
                for w in self.windows.values()
                if w.provider == provider and w.scope in scopes and ask.get(w.kind, 0) > 0
            ),
            key=lambda w: w.id,
        )

    def _by_id(self, window_id: int) -> RateWindow | None:
        return next((w for w in self.windows.values() if w.id == window_id), None)

    def _booked_rows(self, key: str) -> dict[int, RateTake]:
        return {i: t for i, t in self.rate_takes.get(key, {}).items() if t.back_ms is not None}

    def turn(self, key: str) -> RateWindowFull | None:
        """Rule (a booking's turn): read from the windows as they stand, never written
        down: on each window it has come once the level refilled to now plus all that
        is booked covers the line up to and including this booking (ordered by
        virtual time, then arrival); the longest of its windows. None: not booked."""
        longest: RateWindowFull | None = None
        for window_id, mine in sorted(self._booked_rows(key).items()):
            w = self._by_id(window_id)
            if w is None:
                continue
            ahead = sum(
                t[window_id].taken
                for t in self.rate_takes.values()
                if window_id in t
                and t[window_id].back_ms is not None
                and (t[window_id].tag, t[window_id].arrival) <= (mine.tag, mine.arrival)
            )
            short = ahead * 1000 - (self._level(w) + w.booked)
            wait = _refill_ms(short, w.per_minute) if short > 0 else 0
            if longest is None or wait > longest.wait_ms:
                longest = RateWindowFull(w.scope, w.kind, wait)
        return longest

    def _booked_for(self, key: str, windows: list[RateWindow], ask: dict[str, int]) -> bool:
        """Rule (a booking is of its ask): ``key`` is booked for ``ask`` on every one of
        ``windows``; a booking for another ask (a changed request) is dropped whole."""
        booked = self._booked_rows(key)
        return bool(booked) and all(
            w.id in booked and booked[w.id].taken == ask[w.kind] for w in windows
        )

    def _unbook(self, key: str) -> None:
        """Drop what ``key`` booked or took (never sent): all of it back."""
        for window_id, t in self.rate_takes.pop(key, {}).items():
            w = self._by_id(window_id)
            if w is not None:
                self._set_level(w, min(self._level(w) + t.taken * 1000, w.per_minute * 1000))
                if t.back_ms is not None:
                    w.booked -= t.taken * 1000

    def take_rate(
        self,
        key: str,
        provider: str,
        scopes: tuple[str, ...],
        ask: dict[str, int],
        own: tuple[str, ...],
    ) -> bool:
        """Rule (rate admission): a granted call takes its ask from every window of its
        provider whose scope is its, all or none, before its money is admitted; only
        the room no booked call waits for (the level is net of them). An ask past a
        whole limit is refused for good. A booking of the key whose turn has come is
        sent instead: it leaves the line, and the line's present reaches its place.
        False: short (a budget that refuses the call refuses it, else it is booked:
        :meth:`_book`)."""
        windows = self._claimed(provider, scopes, ask)
        if not windows:
            return True
        for w in windows:
            if ask[w.kind] > w.per_minute:
                raise RateAskTooLarge(w.scope, w.kind)
        taken = self.rate_takes.get(key)
        if taken:
            booked = self._booked_rows(key)
            if self._booked_for(key, windows, ask):
                turn = self.turn(key)
                if turn is not None and turn.wait_ms > 0:
                    return False
                for window_id, t in booked.items():
                    w = self._by_id(window_id)
                    if w is not None:
                        w.booked -= t.taken * 1000
                        w.vtime = max(w.vtime, t.tag)
                self.rate_takes[key] = {
                    i: RateTake(t.taken, t.own) for i, t in self.rate_takes[key].items()
                }
                return True
            self._unbook(key)
        saved = self._save()
        took = {}
        for w in windows:
            level = self._level(w)
            if level < ask[w.kind] * 1000:
                self._restore(saved)
                return False
            self._set_level(w, level - ask[w.kind] * 1000)
            took[w.id] = RateTake(ask[w.kind], w.scope in own)
        self.rate_takes[key] = took
        return True

    def _book(
        self,
        key: str,
        budget: str,
        provider: str,
        scopes: tuple[str, ...],
        ask: dict[str, int],
        own: tuple[str, ...],
    ) -> RateWindowFull:
        """Rule (waiting in line): a call short of its windows takes its place in each
        window's line (a booking already made keeps its own) and is told its turn.
        Its level goes below 0 by its ask (a day of the limit at most: else nothing is
        booked, and it is told when there would be room in the line). Its place: its
        tenant's last place there, or the line's present if later; each booking moves
        its tenant on by its ask times WEIGHT_SCALE over its weight."""
        if self._booked_for(key, self._claimed(provider, scopes, ask), ask):
            turn = self.turn(key)
            assert turn is not None
            self._told(key, turn.wait_ms)
            return turn
        if key in self.rate_takes:
            self._unbook(key)
        saved = self._save()
        tenant, weight = self.tenant_of(budget)
        booked = {}
        for w in self._claimed(provider, scopes, ask):
            want = ask[w.kind] * 1000
            level = self._level(w)
            most = w.per_minute * BOOKED_MINUTES * 60 * 1000
            if level - want < -most:
                self._restore(saved)
                wait = _refill_ms(want - most - level, w.per_minute)
                return RateWindowFull(w.scope, w.kind, wait)
            self._set_level(w, level - want)
            w.booked += want
            w.arrivals += 1
            start = max(w.vtime, self.rate_shares.get((w.id, tenant), w.vtime))
            self.rate_shares[(w.id, tenant)] = start - (-ask[w.kind] * WEIGHT_SCALE // weight)
            booked[w.id] = RateTake(ask[w.kind], w.scope in own, 0, start, w.arrivals)
        self.rate_takes[key] = booked
        turn = self.turn(key)
        if turn is None:
            return RateWindowFull(scopes[0], "requests", 0)
        self._told(key, turn.wait_ms)
        return turn

    def _told(self, key: str, wait_ms: int) -> None:
        back = _ms(self.now) + wait_ms
        self.rate_takes[key] = {
            i: RateTake(t.taken, t.own, back, t.tag, t.arrival)
            for i, t in self.rate_takes[key].items()
        }

    def _save(self) -> Saved:
        return (
            {w.id: replace(w) for w in self.windows.values()},
            {k: dict(v) for k, v in self.rate_takes.items()},
            dict(self.rate_shares),
        )

    def _restore(self, saved: Saved) -> None:
        windows, takes, shares = saved
        for k, w in self.windows.items():
            self.windows[k] = windows[w.id]
        self.rate_takes, self.rate_shares = takes, shares

    def give_rate_back(
        self, key: str, counted: dict[str, int] | None, seen: RateSeen | None = None
    ) -> None:
        """Rule (rate settlement): a settled call's windows get back what it took and
        its vendor did not count (``counted``), a released call's every token (the
        request sent stays counted), an unknown call's nothing; its takes are gone.
        Then each is narrowed to what the answer said (``seen``): the level capped at
        what the provider says it has room for, refilled since (a 429's retry-after
        owed, an hour at most), less what is booked in the window's line (the provider
        has not seen those calls); a stated limit below the window's lowers the call's
        own model's windows. Never widened."""
        for window_id, t in self.rate_takes.pop(key, {}).items():
            w = self._by_id(window_id)
            if w is None:
                continue
            if counted is not None and w.kind != "requests":
                back = max(0, t.taken - counted.get(w.kind, 0)) * 1000
                if back:
                    self._set_level(w, min(self._level(w) + back, w.per_minute * 1000))
            told = _narrowing(seen, w.kind, t.own)
            if seen is not None and told is not None:
                self._narrow(w, seen.at_ms, *told, own=t.own)

    def _narrow(
        self, w: RateWindow, at_ms: int, remaining: int, wait_ms: int, stated: int | None, own: bool
    ) -> None:
        now = _ms(self.now)
        since = 0 if now <= at_ms else min(now - at_ms, 3_660_000)
        room = remaining * 1000 - w.per_minute * wait_ms // 60 + w.per_minute * since // 60
        cap = max(room, -w.per_minute * 60_000) - w.booked
        limit = stated if own and stated is not None and stated < w.per_minute else w.per_minute
        level = self._level(w)
        if not (level > cap or limit < w.per_minute):
            return
        w.per_minute = limit
        self._set_level(w, max(min(level, cap, limit * 1000), -limit * OWED_MINUTES * 60 * 1000))

    def drop_abandoned(self, before: datetime) -> int:
        """Rule (abandoned bookings): a booking told to come back before ``before``
        that never did is dropped, what it booked given back (the calls behind it move
        up)."""
        gone = sorted(
            key
            for key, t in self.rate_takes.items()
            if any(x.back_ms is not None and x.back_ms < _ms(before) for x in t.values())
        )
        for key in gone:
            self._unbook(key)
        return len(gone)

    def rate_levels(self) -> dict[tuple[str, str, str], tuple[int, float, int]]:
        """Each window as ``ledger.rates.windows()`` shows it: limit, what it holds now
        (in units), calls booked on it."""
        return {
            k: (
                w.per_minute,
                self._level(w) / 1000,
                sum(
                    1 for t in self.rate_takes.values() if w.id in t and t[w.id].back_ms is not None
                ),
            )
            for k, w in self.windows.items()
        }


def _narrowing(seen: RateSeen | None, kind: str, own: bool) -> tuple[int, int, int | None] | None:
    """Rule (what an answer tells a window): ``(remaining, wait, stated limit)`` of
    ``kind`` where the window is the call's own model's; a shared window only a 429
    that named no limit at all (nothing remains, owing its retry-after); else None."""
    if seen is None:
        return None
    remaining = getattr(seen, kind) if own else None
    stated = getattr(seen, f"{kind}_limit") if own else None
    if remaining is None and stated is None:
        kinds = ("requests", "tokens", "input_tokens", "output_tokens")
        said = any(getattr(seen, k) is not None for k in kinds)
        if said or not seen.wait_ms:
            return None
        remaining = 0
    wait = min(seen.wait_ms, 3_600_000) if remaining == 0 else 0
    remaining = 10**12 if remaining is None else min(remaining, 10**12)
    stated = None if stated is None else min(stated, 10**12)
    return remaining, wait, stated


class LedgerModel(RateRules):
    """The whole ledger as the rules say it must behave."""

    def __init__(self, now: datetime = START) -> None:
        if now.tzinfo is None:
            raise ValueError("the clock is timezone-aware")
        self.now = now.astimezone(UTC)
        self.budgets: dict[str, Budget] = {}
        self.periods: dict[tuple[str, datetime], Period] = {}
        self.attempts: dict[str, Attempt] = {}
        self.operations: dict[str, Operation] = {}
        self.journal: list[Entry] = []
        self.archived: set[datetime] = set()
        self.windows: dict[tuple[str, str, str], RateWindow] = {}
        #: what each key took (or booked, waiting its turn) from each window, by id
        self.rate_takes: Takes = {}
        self.rate_shares: dict[tuple[int, str], int] = {}
        self._window_ids = 0

    def advance(self, to: datetime) -> None:
        """Rule (the clock): time only moves forward, and it moves nothing else. A
        period that has ended stays open until something opens a later one."""
        if to.tzinfo is None or to < self.now:
            raise ValueError(f"the clock moves forward only, not to {to!r}")
        self.now = to.astimezone(UTC)

    def budget(self, name: str) -> Budget:
        if name not in self.budgets:
            raise UnknownBudget(name)
        return self.budgets[name]

    def tenant_of(self, budget: str) -> tuple[str, int]:
        for b in self.chain(budget):
            if b.rate_weight is not None:
                return b.name, b.rate_weight
        return budget, 1

    def set_rate_weight(self, budget: str, weight: int | None) -> None:
        """Rule (a tenant's weight): 1 to 1000, or None; it counts from the next
        booking on (places already taken stay)."""
        if weight is not None and not 1 <= weight <= 1000:
            raise ValueError(weight)
        self.budget(budget).rate_weight = weight

    def usable(self, name: str) -> int:
        """What one admission on ``name`` could take now: the least available along its
        chain (an ancestor's counts the grants below it held unused, which an admission
        takes back); 0 if any of the chain is frozen."""
        chain, at = [], self.budget(name)
        while True:
            chain.append(at)
            if at.parent is None:
                break
            at = self.budget(at.parent)
        if any(b.frozen for b in chain):
            return 0
        return max(min(self.balance(b.name).available for b in chain), 0)

    def chain(self, name: str) -> list[Budget]:
        """Rule (the chain): a budget and its ancestors, the budget first."""
        found = [self.budget(name)]
        while found[-1].parent is not None:
            found.append(self.budgets[found[-1].parent])
        return found

    def _check_nested(self, name: str, period: Kind, parent: str | None) -> None:
        """Rule (escrow and slices nest): each ancestor's period must contain the
        budget's own (see ``contains``); otherwise the real ledger refuses."""
        for ancestor in [] if parent is None else self.chain(parent):
            if not contains(ancestor.period, period):
                raise ValueError(f"{name!r} ({period}) does not nest in {ancestor.name!r}")

    def create_budget(
        self,
        name: str,
        cap: int,
        *,
        period: Kind = "none",
        parent: str | None = None,
        renewal: Renewal = "reset",
        rollover_ceiling: int | None = None,
        escrow: bool = False,
        slices: int = 1,
    ) -> Budget:
        """Rule (a budget): a node of the tree with a period kind, a renewal, an
        allowance (``cap``) and a ceiling not below it; ``none`` never renews; escrow
        needs a parent. Escrowed or sliced, it must nest in its ancestors' periods."""
        money(cap, "cap")
        if name in self.budgets:
            raise BudgetExists(name)
        if "#slice" in name:
            raise ValueError(f"{name!r}: names with #slice are slices'")
        if period not in PERIODS or renewal not in RENEWALS:
            raise ValueError(f"period {period!r}, renewal {renewal!r}")
        if period == "none" and renewal != "reset":
            raise ValueError("a budget with period 'none' never renews")
        if rollover_ceiling is not None:
            money(rollover_ceiling, "rollover_ceiling")
            if renewal != "rollover" or rollover_ceiling < cap:
                raise ValueError("a ceiling is a rollover's, and not below the cap")
        _check_slices(slices)
        if parent is not None:
            self.budget(parent)
        if escrow and parent is None:
            raise ValueError(f"budget {name!r}: escrow needs a parent")
        if escrow or slices > 1:
            self._check_nested(name, period, parent)
        made = Budget(name, cap, period, parent, renewal, rollover_ceiling, escrow, slices)
        self.budgets[name] = made
        return made

    def set_slices(self, name: str, slices: int) -> Budget:
        """Rule (slices are invisible): a budget's money is the same whatever its number
        of slices; going from n slices to 1 keeps what the former slices spent and hold
        in its figures. Slicing needs the budget to nest in its ancestors' periods."""
        _check_slices(slices)
        budget = self.budget(name)
        if slices > budget.slices:
            self._check_nested(name, budget.period, budget.parent)
        budget.slices = slices
        return budget

    def freeze(self, name: str) -> None:
        """Rule (freeze): a frozen budget admits nothing for itself or for any budget
        under it; settlements, releases and resolutions go on. Like the real ledger,
        it opens the budget's current period for its journal row."""
        self._set_frozen(name, True)

    def unfreeze(self, name: str) -> None:
        """Rule (unfreeze): the budget admits again (its own flag only)."""
        self._set_frozen(name, False)

    def _set_frozen(self, name: str, frozen: bool) -> None:
        period = self._open(self.budget(name))
        self.budgets[name].frozen = frozen
        kind = "freeze" if frozen else "unfreeze"
        self.journal.append(Entry(kind, name, period.start, None))

    def set_cap(self, name: str, cap: int) -> Budget:
        """Rule (cap change): the new allowance applies to later periods, and the
        current period's cap (opened if needed) moves by the same delta, so what it
        carried stays. Refused (CapBelowCommitted) if that would put the current cap
        below the period's rolled-up spent + held (all of its subtree, slices and
        escrowed budgets included); refused (ValueError) above an explicit ceiling."""
        money(cap, "cap")
        budget = self.budget(name)
        period = self._open(budget)
        if budget.ceiling is not None and cap > budget.ceiling:
            raise ValueError(f"cap {cap} is above {name!r}'s rollover ceiling")
        delta = cap - budget.allowance
        spent, held, _ = self.figures(name, period.start)
        if period.cap + delta < spent + held:
            raise CapBelowCommitted(name, cap, spent + held)
        budget.allowance = cap
        if delta:
            period.cap += delta
            self.journal.append(Entry("cap", name, period.start, None, cap=delta))
        return budget

    def open_period(self, name: str) -> Balance:
        """Open the budget's current period (``ledger.upkeep.open_period``)."""
        self._open(self.budget(name))
        return self.balance(name)

    def renew_all(self, order: Iterable[str] | None = None) -> None:
        """Rule (beat's renewal): open the current period of every periodic budget, in
        any order; the figures do not depend on the order."""
        for name in sorted(self.budgets) if order is None else order:
            if self.budget(name).period != "none":
                self._open(self.budgets[name])

    def _open(self, budget: Budget) -> Period:
        """Rule (opening): a period opens lazily (a reservation, admitted or refused,
        a delivery, set_cap, freeze, open_period, beat). Opening closes every earlier
        open period of that budget and of the escrowed budgets below it (any depth:
        an escrowed tenant's period ends with its parent's; a sliced budget that is
        not escrowed keeps its own open), and the one just before carries into it
        (``opening_cap``) as it stands at that moment. That moment is this budget's
        own opening, whatever other budgets of the tree opened before or after it."""
        start = period_start(budget.period, self.now)
        if (budget.name, start) in self.periods:
            return self.periods[(budget.name, start)]
        cap, previous = self.opening_cap(budget, start)
        for period in self.periods.values():
            if period.start < start and (
                period.budget == budget.name or self._escrowed_below(period.budget, budget)
            ):
                period.closed = True
        if previous is not None:
            previous.carried_out = cap - budget.allowance
        opened = self.periods[(budget.name, start)] = Period(budget.name, start, cap)
        return opened

    def _escrowed_below(self, name: str, above: Budget) -> bool:
        """``name`` is escrowed and ``above`` is one of its ancestors."""
        return self.budgets[name].escrow and any(b.name == above.name for b in self.chain(name)[1:])

    def opening_cap(self, budget: Budget, start: datetime) -> tuple[int, Period | None]:
        """Rule (renewal): ``reset`` opens at the allowance. ``rollover`` opens at
        max(allowance, min(ceiling, allowance + unused)), where unused is
        max(0, cap - spent - held) of the period just before, rolled up, as it stands
        now (open holds are not carried). It only counts if that period was opened;
        closed already by its parent's next period, it carries all the same. Returns
        the cap and the period that carries into it."""
        before = previous_period_start(budget.period, start)
        previous = self.periods.get((budget.name, before)) if before else None
        if budget.renewal == "reset" or previous is None:
            return budget.allowance, None
        unused = max(0, self.available(previous))
        limit = budget.ceiling
        if limit is None:
            limit = DEFAULT_ROLLOVER_MULTIPLE * budget.allowance
        carried = min(limit, budget.allowance + unused)
        return max(budget.allowance, carried), previous

    def _give_back_carry(self, attempt: Attempt) -> None:
        """Rule (late charge after a carry): a late charge or correction that leaves a
        closed period less unused than it carried takes the difference off its
        carried_out and off the next period's cap. If that period carried too, the
        same rule applies to it, and so on down the line."""
        for name, start in attempt.periods.items():
            period = self.periods[(name, start)]
            while period.carried_out > max(self.available(period), 0):
                deficit = period.carried_out - max(self.available(period), 0)
                period.carried_out -= deficit
                after = next_period_start(self.budgets[name].period, period.start)
                assert after is not None  # a period that carried has a next one
                period = self.periods[(name, after)]
                period.cap -= deficit

    def figures(self, name: str, start: datetime) -> tuple[int, int, int]:
        """Rule (roll-up): a budget's spent, held and overrun in a period are summed over
        every attempt that holds in that period: attempts admitted on the budget or on
        any budget under it (escrowed or not, any slice), in the descendants' periods
        that lie inside this one. Escrow and slices change nothing here."""
        spent = held = overrun = 0
        for attempt in self.attempts.values():
            if attempt.periods.get(name) == start:
                spent += attempt.spent
                held += attempt.held
                overrun += attempt.overrun
        return spent, held, overrun

    def available(self, period: Period) -> int:
        """Rule (available): cap - spent - held, rolled up. Admission never makes it
        negative. Only an overrun, a positive adjustment, or a carry taken back after
        one makes it negative."""
        spent, held, _ = self.figures(period.budget, period.start)
        return period.cap - spent - held

    def reserve(
        self,
        budget: str,
        key: str,
        amount: int,
        *,
        reason: str = "first",
        operation: str | None = None,
        rate: tuple[str, tuple[str, ...], dict[str, int], tuple[str, ...]] | None = None,
    ) -> Attempt:
        """Rule (admission): admitted iff no budget of the chain is frozen and every
        budget X of the chain has, in its period containing now, cap - spent - held >=
        amount (rolled up). An amount exactly equal to what is left is admitted. Frozen
        wins over exceeded (BudgetFrozen, else BudgetExceeded naming the first short
        budget from the root). A refusal changes nothing, apart from the opened periods.
        The attempt keeps the periods it was admitted in: its settlement charges them,
        however late. An existing key with the same budget and amount returns its
        attempt; another budget or amount is an IdempotencyConflict."""
        money(amount)
        chain = self.chain(budget)
        periods = [self._open(b) for b in chain]
        if key in self.attempts:
            found = self.attempts[key]
            if (found.budget, found.amount) != (budget, amount):
                raise IdempotencyConflict(key)
            return found
        saved = self._save()
        taken = True if rate is None else self.take_rate(key, *rate)
        try:
            for b in reversed(chain):
                if b.frozen:
                    raise BudgetFrozen(b.name)
            for b, period in reversed(list(zip(chain, periods, strict=True))):
                if self.available(period) < amount:
                    raise BudgetExceeded(b.name, amount, self.available(period))
        except (BudgetFrozen, BudgetExceeded):
            self._restore(saved)  # one transaction: what the windows gave rolls back
            raise
        if rate is not None and not taken:
            # a window was short and the budget has room: it waits in line
            self._restore(saved)
            raise self._book(key, budget, *rate)
        holds_in = {period.budget: period.start for period in periods}
        made = Attempt(key, budget, amount, holds_in, reason, operation)
        self.attempts[key] = made
        self._write("hold", made, held=amount)
        return made

    def attempt(self, key: str) -> Attempt:
        if key not in self.attempts:
            raise UnknownAttempt(key)
        return self.attempts[key]

    def mark_sending(self, key: str) -> None:
        """Rule (the one grant): reserved -> sending, once."""
        attempt = self.attempt(key)
        if attempt.state != "reserved":
            raise InvalidTransition(key, attempt.state, "mark sending")
        attempt.state = "sending"

    def mark_unknown(self, key: str, reason: str = "outcome unknown") -> bool:
        """Rule (no money released by a timer): sending -> unknown keeps the hold until
        someone resolves it. False if it was unknown already."""
        attempt = self.attempt(key)
        if attempt.state == "unknown":
            return False
        if attempt.state != "sending":
            raise InvalidTransition(key, attempt.state, "mark unknown")
        attempt.state = "unknown"
        self.give_rate_back(key, None)
        return True

    def settle(
        self,
        key: str,
        actual: int,
        counted: dict[str, int] | None = None,
        seen: RateSeen | None = None,
    ) -> bool:
        """Rule (settlement): from sending or unknown, held -= reserved and spent +=
        actual in every period the attempt holds in. An actual above the reservation is
        an overrun, charged as it is. Settling again at the same actual is a no-op
        (False); at another actual, a SettlementConflict."""
        return self._resolve(key, money(actual, "actual"), "settled", counted, seen)

    def release(self, key: str, reason: str = "not billed", seen: RateSeen | None = None) -> bool:
        """Rule (release): from reserved, sending or unknown, held -= reserved; nothing
        is charged. Releasing again is a no-op; releasing a charged attempt conflicts."""
        return self._resolve(key, 0, "released", {}, seen)

    def resolve(self, key: str, actual: int) -> bool:
        """Rule (resolution): an operator or reconciliation settles at ``actual`` > 0
        and releases at 0. An attempt never sent (reserved) is never charged."""
        if money(actual, "actual") == 0:
            return self.release(key, "resolved at 0")
        return self.settle(key, actual)

    def _resolve(
        self,
        key: str,
        actual: int,
        state: str,
        counted: dict[str, int] | None = None,
        seen: RateSeen | None = None,
    ) -> bool:
        attempt = self.attempt(key)
        if attempt.state in ("settled", "released"):
            if attempt.actual == actual:
                return False
            raise SettlementConflict(key, attempt.actual, actual)
        allowed = ("sending", "unknown") if state == "settled" else HOLDING
        if attempt.state not in allowed:
            raise InvalidTransition(key, attempt.state, state)
        kind = "charge" if state == "settled" else "release"
        self._write(kind, attempt, held=-attempt.amount, spent=actual)
        attempt.state, attempt.actual = state, actual
        self._give_back_carry(attempt)
        self.give_rate_back(key, counted, seen)
        return True

    def adjust(self, key: str, delta: int, ref: str | None = None) -> bool:
        """Rule (correction): a settled or released attempt's charge moves by ``delta``
        (never below 0), in its own periods, once per ``ref``. An attempt that holds in
        an archived month left with it (UnknownAttempt)."""
        attempt = self.attempt(key)
        if self.in_archived_month(attempt):
            raise UnknownAttempt(key)
        if not isinstance(delta, int) or isinstance(delta, bool) or delta == 0:
            raise ValueError(f"an adjustment is a non-zero int, not {delta!r}")
        if attempt.state not in ("settled", "released"):
            raise InvalidTransition(key, attempt.state, "adjust before settlement")
        if ref is not None and any(ref == seen for seen, _ in attempt.adjustments):
            return False
        if attempt.spent + delta < 0:
            raise ValueError(f"adjustment {delta} takes {key!r} below zero")
        attempt.adjustments.append((ref, delta))
        self._write("adjustment", attempt, spent=delta)
        self._give_back_carry(attempt)
        return True

    def in_archived_month(self, attempt: Attempt) -> bool:
        """One of the periods ``attempt`` holds in lies in a month retention archived."""
        return any(period_start("month", s) in self.archived for s in attempt.periods.values())

    def _write(self, kind: str, attempt: Attempt, held: int = 0, spent: int = 0) -> None:
        """Rule (the journal): every change of held or spent is one journal row in each
        period the attempt holds in."""
        for name, start in attempt.periods.items():
            self.journal.append(Entry(kind, name, start, attempt.key, held, spent))

    def operation(self, key: str) -> Operation:
        if key not in self.operations:
            raise UnknownOperation(key)
        return self.operations[key]

    def deliver(self, key: str, budget: str, amount: int) -> str | None:
        """Rule (a delivery): a succeeded operation replays (None, nothing admitted); a
        failed one raises OperationFailed; otherwise its next attempt (``key#n``) is
        admitted and granted, and the operation runs. A refusal records its reason and
        leaves the operation ``pending`` (it waits for budget) with its next reason
        kept: a reopened operation's next attempt is still ``manual``, so once the
        budget frees, the next delivery runs it.

        Every delivery first opens its budget chain's current periods, as any admission
        does, whatever it then finds (a replay too): on a day beat did not renew, that
        decides what a rollover budget's next period carries."""
        for b in self.chain(budget):
            self._open(b)
        op = self.operations.setdefault(key, Operation(key))
        if op.status == "succeeded":
            return None
        if op.status == "failed":
            raise OperationFailed(key)
        if op.status == "running":
            raise OperationInProgress(key)
        attempt_key = f"{key}#{len(op.attempts) + 1}"
        try:
            self.reserve(budget, attempt_key, amount, reason=op.next_reason, operation=key)
        except (BudgetExceeded, BudgetFrozen) as refused:
            op.refusal = f"{type(refused).__name__}: {refused.args}"
            op.status = "pending"
            raise
        self.mark_sending(attempt_key)
        op.attempts.append(attempt_key)
        op.status, op.refusal, op.next_reason = "running", None, "redelivery"
        return attempt_key

    def finish_operation(self, key: str, actual: int) -> None:
        """Rule (success): the run's attempt is settled at ``actual``; it succeeded."""
        op = self.operation(key)
        self.settle(op.attempts[-1], actual)
        op.status = "succeeded"

    def fail_operation(self, key: str, actual: int | None = 0) -> None:
        """Rule (failure): the run's attempt is resolved at ``actual`` (None: its outcome
        is unknown, and it keeps its hold); the operation failed for good."""
        op = self.operation(key)
        if actual is None:
            self.mark_unknown(op.attempts[-1], "the run failed mid-call")
        else:
            self.resolve(op.attempts[-1], actual)
        op.status = "failed"

    def reopen_operation(self, key: str) -> Operation:
        """Rule (reopen): an operator reopens a failed operation none of whose attempts
        holds money. It becomes runnable (``retryable``) and its next attempt's reason
        is ``manual``."""
        op = self.operation(key)
        if op.status != "failed":
            raise CannotReopen(key, f"it is {op.status}")
        # a hold of 0 is a hold: its call may have gone out, and may yet be charged
        if any(self.attempts[a].state in HOLDING for a in op.attempts):
            raise CannotReopen(key, "a call still holds money")
        op.status, op.next_reason = "retryable", "manual"
        return op

    def retain(self, month: datetime) -> str | None:
        """Rule (retention): a month that has ended is archived (None is returned) only
        when every period that began in it is closed, no attempt holding in ANY of those
        periods is reserved, sending or unknown (in a mixed-kind chain, that includes a
        parent's period whose attempt's own period lies in a later month), and no
        operation of those attempts is unfinished; else the reason is returned.
        Archiving never changes a figure."""
        start = period_start("month", month)
        end = next_period_start("month", start)
        if start in self.archived:
            return None
        if end is None or self.now < end:
            return "the month has not ended"
        inside = {(p.budget, p.start) for p in self.periods.values() if start <= p.start < end}
        for name, began in sorted(inside):
            if not self.periods[(name, began)].closed:
                return f"period {name} {began:%Y-%m-%d} is open"
        for attempt in self.attempts.values():
            if not inside.isdisjoint(attempt.periods.items()):
                if attempt.state in HOLDING:
                    return f"attempt {attempt.key} holds money"
                op = self.operations.get(attempt.operation or "")
                if op is not None and op.status not in ("succeeded", "failed"):
                    return f"operation {op.key} is unfinished"
        self.archived.add(start)
        return None

    def balance(self, name: str) -> Balance:
        """Rule (a view): the budget's current period, rolled up. A read opens nothing.
        A period not yet open shows what it would open with now, with nothing spent or
        held."""
        budget = self.budget(name)
        start = period_start(budget.period, self.now)
        period = self.periods.get((name, start))
        if period is None:
            cap = self.opening_cap(budget, start)[0]
            return Balance(name, cap, 0, 0, cap, start)
        spent, held, _ = self.figures(name, start)
        return Balance(name, period.cap, spent, held, period.cap - spent - held, start)

    def report(self) -> list[BudgetReport]:
        """Every budget's balance, by name, with its frozen flag and its overrun."""
        rows = []
        for name, budget in sorted(self.budgets.items()):
            b = self.balance(name)
            overrun = self.figures(name, b.period_start)[2]
            rows.append(BudgetReport(**asdict(b), frozen=budget.frozen, overrun=overrun))
        return rows

    def holds(self) -> list[Hold]:
        """Every attempt that holds money, oldest first, at its own budget's period."""
        return [
            Hold(a.key, a.budget, a.amount, a.state, a.periods[a.budget])
            for a in self.attempts.values()
            if a.state in HOLDING  # a hold of 0 is a hold too: the call may still go out
        ]

    def journal_sums(self) -> dict[tuple[str, datetime], tuple[int, int, int]]:
        """Rule (the audit's sums): per period, the journal's held, its spent, and its
        overrun (the charge rows' spent + held where that is positive)."""
        sums: dict[tuple[str, datetime], tuple[int, int, int]] = {}
        for e in self.journal:
            held, spent, overrun = sums.get((e.budget, e.period_start), (0, 0, 0))
            over = max(0, e.spent + e.held) if e.kind == "charge" else 0
            sums[(e.budget, e.period_start)] = (held + e.held, spent + e.spent, overrun + over)
        return sums

    def audit(self) -> list[tuple[str, datetime, str, int, int]]:
        """Rule (honest ledger): every period's counters equal the sums of its journal.
        Returns the differences (budget, period, counter, figure, journal)."""
        sums = self.journal_sums()
        found = []
        for name, start in sorted(self.periods):
            spent, held, overrun = self.figures(name, start)
            j_held, j_spent, j_overrun = sums.get((name, start), (0, 0, 0))
            for counter, figure, journal in (
                ("held", held, j_held),
                ("spent", spent, j_spent),
                ("overrun", overrun, j_overrun),
            ):
                if figure != journal:
                    found.append((name, start, counter, figure, journal))
        return found


def _check_slices(slices: object) -> None:
    if isinstance(slices, bool) or not isinstance(slices, int) or not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"slices must be an int from 1 to {MAX_SLICES}, not {slices!r}")
