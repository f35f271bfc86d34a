"""The ledger's shared core: its engine and driver, the database's clock, the budget
chains and periods it caches, and the primitives every part admits and settles with
(reserve in a transaction, resolve an attempt, apply counters, journal)."""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import (
    Row,
    func,
    select,
)

from .. import _validate as check
from .._redact import redact
from ..errors import (
    BudgetExceeded,
    BudgetFrozen,
    IdempotencyConflict,
    InvalidTransition,
    LedgerUnavailable,
    RateWindowFull,
    SettlementConflict,
    UnknownAttempt,
    UnknownBudget,
    UsageRecorded,
)
from . import escrow, functions, partitions, rate_takes
from . import statements as sql
from .counters import _apply, _journal
from .driver import DEADLOCK, Cursor, Declined, Driver
from .engine import build_engine
from .periods import (
    PeriodClosed,
    opening_cap,
    period_start,
    previous_period_start,
)
from .records import (
    NOTHING_ANSWERED,
    UNTRUSTED_LOOKUP,
    Answered,
    Attempt,
    CallFacts,
    RateAsk,
    RateSeen,
    Reservation,
    kept,
    stored_limit,
)
from .schema import metadata, new_installation_id
from .states import attempt_may

log = logging.getLogger("budget_tasks.ledger")

Clock = Callable[[], datetime]
#: (id, name, period) of a budget and each ancestor, the budget first
Chain = tuple[tuple[int, str, str], ...]


class HoldPlan(NamedTuple):
    """Where an admission holds, found before its transaction begins."""

    #: each budget's admitting period (id, start)
    periods: dict[int, tuple[int, datetime]]
    #: the (budget, period) pairs to hold in, by budget id
    holds: list[tuple[int, int]]
    #: the escrowed budget the holds stop at, if any
    escrow: escrow.Escrow | None


T = TypeVar("T")


def attempt_row(
    chain: Chain,
    key: str,
    amount: int,
    reason: str,
    *,
    fingerprint: str | None,
    price_version: str | None,
    operation_id: int | None = None,
    label: str | None = None,
    step: str | None = None,
) -> dict[str, Any]:
    """The attempt row an admission inserts: a main call's (no label), a labelled
    call's, or a direct reservation's."""
    return {
        "key": key,
        "budget_id": chain[0][0],
        "fingerprint": fingerprint,
        "reason": reason,
        "amount": amount,
        "price_version": price_version,
        "operation_id": operation_id,
        "label": label,
        "step": step,
    }


def made_now(
    owner: str, start: datetime, row: dict[str, Any], facts: CallFacts | None
) -> Reservation:
    """The reservation an admission made of ``row`` (see :func:`attempt_row`): on
    ``owner``'s budget, in the period from ``start``, granted where ``facts`` say what
    the call is."""
    state = "sending" if facts is not None else "reserved"
    return Reservation(
        row["key"], owner, row["amount"], start, state, row["reason"], row["fingerprint"], True
    )


#: How often a host reads again how many slices a sliced budget has.
SLICES_REREAD_SECONDS = 60.0
#: A slice of budget ``x`` is the budget ``x#slice<k>``; no other budget is so named.
SLICE_MARK = "#slice"


def slice_name(owner: str, index: int) -> str:
    return f"{owner}{SLICE_MARK}{index}"


def is_slice_name(name: str) -> bool:
    head, mark, tail = name.rpartition(SLICE_MARK)
    return bool(mark) and bool(head) and tail.isdigit()


#: How often the ledger measures this host's clock against the database's.
CLOCK_CHECK_SECONDS = 60.0
#: A difference between the clocks smaller than this is taken for none.
CLOCK_AGREEMENT = timedelta(milliseconds=50)


#: How many times an admission aborted to break a deadlock runs again.
DEADLOCK_RETRIES = 3


def _deadlocked(exc: BaseException) -> bool:
    """Whether ``exc`` (a LedgerUnavailable) is PostgreSQL's abort of a deadlocked
    transaction."""
    cause = exc.__cause__
    found = getattr(cause, "orig", None) or cause
    return getattr(found, "sqlstate", None) == DEADLOCK


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Store:
    """The ledger's store: its engine and driver, the clocks, the caches of budget chains
    and periods, and the write primitives every caller admits and settles with. Held
    (never inherited) by each caller's class."""

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        max_stored_bytes: int | None = None,
        server_functions: bool = True,
        **engine_options: Any,
    ) -> None:
        self.max_stored = stored_limit(max_stored_bytes)
        self.engine = build_engine(url, **engine_options)
        self.url = self.engine.url.render_as_string(hide_password=True)
        self.clock = clock
        #: The database's clock minus this host's, measured now and then: the ledger
        #: keeps time by the database, so that hosts whose clocks disagree still agree
        #: on which period a reservation falls in.
        self.offset: timedelta | None = None
        self.offset_at = 0.0
        self.lock = threading.Lock()
        # Budgets are never deleted or re-parented, and period rows never move, so
        # their ids are safe to cache for the life of the process.
        self.chains: dict[str, tuple[tuple[int, str, str], ...]] = {}
        self.period_ids: dict[tuple[int, datetime], tuple[int, datetime]] = {}
        #: escrowed budget id -> its parent's id
        self.escrowed: dict[int, int] = {}
        #: chain -> where its holds stop (see _escrow_of)
        self.stops: dict[Chain, escrow.Escrow | None] = {}
        #: a sliced budget's name -> (when read, its slices' names)
        self.slice_names: dict[str, tuple[float, tuple[str, ...]]] = {}
        self.dialect = self.engine.dialect.name
        self.installation: str | None = None
        self.driver = Driver(self.engine)
        #: PostgreSQL: a delivery's admission and a run's settlement are first sent as
        #: one statement each (see :mod:`.functions`); False sends only the statements.
        self.use_functions = server_functions and not self.driver.sqlite

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def kept_text(self, encoded: str) -> str:
        """What is stored of ``encoded`` (a result, an answer, for replay): itself, or
        past the size cap only its digest and size (see :func:`.records.not_kept`)."""
        return kept(encoded, self.max_stored)

    def dispose(self) -> None:
        """Close this ledger's database connections."""
        self.driver.close()
        self.engine.dispose()

    def create_schema(self) -> None:
        """Create the ledger tables if missing (tests, the embedded SQLite default).

        Production PostgreSQL uses the migrations: ``budget-tasks db upgrade``.
        """
        with self.driver.transaction() as cur:
            metadata.create_all(cur.conn)
            if not self.driver.sqlite:
                now = self.now()
                partitions.make_months(cur, now, partitions.ahead_of(now))

    def installation_id(self) -> str:
        """This ledger's own id, made with its tables (and kept for good)."""
        found = self.installation
        if found is None:
            with self.driver.transaction() as cur:
                row = cur.one(sql.INSTALLATION, {})
                if row is None:
                    cur.run(
                        sql.INSERT_INSTALLATION,
                        {
                            "installation_id": new_installation_id(),
                            "now": self.driver.ts(_utcnow()),
                        },
                    )
                    row = cur.one(sql.INSTALLATION, {})
            assert row is not None
            found = self.installation = str(row[0])
        return found

    def provider_key(self, key: str) -> str:
        """What the provider is sent as attempt ``key``'s key (its Idempotency-Key, a
        stored completion's metadata): an opaque digest of this ledger's installation
        id and the key. A business key may hold a customer's e-mail or a tenant's name:
        it never leaves the ledger; and two ledgers on one API key never share one."""
        check.text(key, "key")
        digest = hashlib.sha256(f"{self.installation_id()}\n{key}".encode()).hexdigest()
        return f"bt1-{digest[:48]}"

    def now(self) -> datetime:
        """The current time: the ``clock`` given, else the database's (this host's
        clock corrected by its offset from the database, measured every minute)."""
        if self.clock is None:
            return self.database_now()
        now = self.clock()
        if now.tzinfo is None:
            raise ValueError("the ledger clock must return timezone-aware datetimes")
        return now.astimezone(UTC)

    def database_now(self) -> datetime:
        local = _utcnow()
        if self.dialect == "sqlite":
            return local  # the database is a file on this host: its clock is this one
        since = time.monotonic() - self.offset_at
        if self.offset is None or since > CLOCK_CHECK_SECONDS:
            try:
                with self.driver.transaction() as cur:  # connected (and pinged) first
                    before = _utcnow()
                    # clock_timestamp(): the time of this statement, not of the
                    # transaction's start; halfway through the round trip, the error is
                    # half of one round trip.
                    theirs = cur.execute(select(func.clock_timestamp())).scalar_one()
                    after = _utcnow()
                offset = theirs.astimezone(UTC) - (before + (after - before) / 2)
                # Below what one measurement can tell apart, the clocks agree: keep this
                # host's time (stamps then order with this host's other clocks).
                self.offset = offset if abs(offset) > CLOCK_AGREEMENT else timedelta(0)
                self.offset_at = time.monotonic()
            except LedgerUnavailable:
                if self.offset is None:
                    raise
        assert self.offset is not None
        return local + self.offset

    def chain(self, name: str) -> Chain:
        """(id, name, period) of the budget and each ancestor, the budget first."""
        chain = self.chains.get(name)
        if chain is not None:
            return chain
        with self.driver.transaction() as cur:
            found: list[tuple[int, str, str]] = []
            escrowed: list[tuple[int, int]] = []
            row = cur.one(sql.BUDGET_LINK_BY_NAME, {"name": name})
            if row is None:
                raise UnknownBudget(name)
            while row is not None:
                budget_id, budget_name, period, parent_id, escrow_on, _ = row
                found.append((int(budget_id), budget_name, period))
                if parent_id is None:
                    break
                if escrow_on:
                    escrowed.append((int(budget_id), int(parent_id)))
                row = cur.one(sql.BUDGET_LINK, {"budget_id": parent_id})
        chain = tuple(found)
        with self.lock:
            self.chains[name] = chain
            # Escrow is chosen when a budget is made and never changes: safe to keep.
            self.escrowed.update(escrowed)
        return chain

    def admission_chain(self, budget: str) -> Chain:
        """The chain an admission on ``budget`` holds in: a sliced budget's is one of
        its slices' at random (each an escrowed budget under it), any other its own."""
        chain = self.chain(budget)
        names = self.slices_of(chain[0])
        return self.chain(random.choice(names)) if names else chain

    def slices_of(self, link: tuple[int, str, str]) -> tuple[str, ...]:
        budget_id, name, _ = link
        cached = self.slice_names.get(name)
        if cached is not None and time.monotonic() - cached[0] < SLICES_REREAD_SECONDS:
            return cached[1]
        with self.driver.transaction() as cur:
            row = cur.one(sql.BUDGET_LINK, {"budget_id": budget_id})
            count = 1 if row is None else int(row[5])
            names: tuple[str, ...] = ()
            if count > 1:
                found = cur.all(sql.SLICE_NAMES, {"owner_id": budget_id, "slices": count})
                names = tuple(str(r[0]) for r in found)
        with self.lock:
            self.slice_names[name] = (time.monotonic(), names)
        return names

    @staticmethod
    def owner_of(chain: Chain) -> str:
        """The budget an admission on ``chain`` is for: a slice's owner, or its first."""
        name = chain[0][1]
        return chain[1][1] if len(chain) > 1 and is_slice_name(name) else name

    @staticmethod
    def tenants_of(chain: Chain) -> tuple[int, ...]:
        """The budgets a call on ``chain`` may share rate windows as, nearest first: a
        slice's owner and up (a budget's slices are one tenant), or its own chain."""
        if len(chain) > 1 and is_slice_name(chain[0][1]):
            chain = chain[1:]
        return tuple(budget_id for budget_id, _, _ in chain)

    def escrow_of(self, chain: Chain) -> escrow.Escrow | None:
        """Where the chain's holds stop: its first escrowed budget, from the bottom
        (kept: a chain and its budgets' escrow never change)."""
        if chain in self.stops:
            return self.stops[chain]
        stop = None
        for depth, (budget_id, name, _) in enumerate(chain):
            parent_id = self.escrowed.get(budget_id)
            if parent_id is not None:
                above = sorted(chain[depth + 1 :])
                stop = escrow.Escrow(budget_id, name, parent_id, tuple(above))
                break
        with self.lock:
            self.stops[chain] = stop
        return stop

    def period_id(self, budget_id: int, start: datetime) -> tuple[int, datetime]:
        """The id and start of the period admission uses when the clock says ``start``:
        that period, opened if new (closing every earlier one first); or, if a later
        period is open already (this host's clock is behind), that later one."""
        cached = self.period_ids.get((budget_id, start))
        if cached is not None:
            return cached
        with self.driver.transaction() as cur:
            found = self.open_period_in(cur, budget_id, start)
        with self.lock:
            self.period_ids[(budget_id, start)] = found
        return found

    def forget_periods(self, budget_ids: Iterable[int]) -> None:
        ids = set(budget_ids)
        with self.lock:
            for slot in [slot for slot in self.period_ids if slot[0] in ids]:
                del self.period_ids[slot]

    def open_period_in(self, cur: Cursor, budget_id: int, start: datetime) -> tuple[int, datetime]:
        ts = self.driver.ts
        at = {"budget_id": budget_id, "start": ts(start)}
        latest = cur.one(sql.LATEST_PERIOD_FROM, at)
        if latest is not None:
            return int(latest[0]), self.driver.from_ts(latest[1])
        renewal = cur.one(sql.BUDGET_RENEWAL, {"budget_id": budget_id})
        assert renewal is not None  # the chain named it
        period, budget_cap, policy, ceiling = renewal
        stamp = ts(self.now())
        below = cur.all(
            sql.CLOSE_ESCROWED_BELOW_BEFORE,
            {**at, "parent_id": budget_id, "now": stamp, "true": True},
        )
        for (period_id,) in below:
            # escrowed budgets under this one (its slices, its escrowed tenants and
            # theirs) end their period with it: what they hold unused comes back before the carry
            escrow.give_back(cur, int(period_id), stamp, "the period ended")
        closed = cur.all(sql.CLOSE_PERIODS_BEFORE, {**at, "now": stamp})
        for (period_id,) in closed:
            # A closed escrowed period admits nothing more: what it drew and did not
            # use goes back to its ancestors (a no-op for any other period).
            escrow.give_back(cur, int(period_id), stamp, "the period ended")
        prev_start = previous_period_start(period, start)
        # Read after the close, open or closed already: a parent's next period closes
        # its escrowed budgets' periods when it opens first, and they carry all the same.
        previous = (
            None
            if prev_start is None
            else cur.one(sql.CARRY_FROM, {"budget_id": budget_id, "start": ts(prev_start)})
        )
        counters = None if previous is None else (previous[1], previous[2], previous[3])
        cap = opening_cap(budget_cap, policy, ceiling, counters)
        # Two openers may race: the unique (budget_id, period_start) keeps the winner's
        # row, and only the winner records what the period before carried.
        made = cur.one(sql.INSERT_PERIOD, {**at, "cap": cap, "now": ts(self.now())})
        if made is not None and previous is not None and cap > budget_cap:
            cur.run(sql.SET_CARRIED_OUT, {"carried": cap - budget_cap, "period_id": previous[0]})
        row = cur.one(sql.PERIOD_ID, at)
        assert row is not None
        return int(row[0]), start

    def find_holds(self, chain: Chain, now: datetime) -> HoldPlan:
        """Each budget's admitting period at ``now``, the (budget, period) pairs to hold
        in, in budget-id order (the order every writer locks them in), and where the
        holds stop: the first escrowed budget from the bottom, whose ancestors see its
        grants, not each hold."""
        periods = {
            budget_id: self.period_id(budget_id, period_start(period, now))  # type: ignore[arg-type]
            for budget_id, _, period in chain
        }
        stop = self.escrow_of(chain)
        # an escrowed budget's ancestors are the end of its chain: they are not held in
        held = chain if stop is None else chain[: len(chain) - len(stop.ancestors)]
        holds = sorted((budget_id, periods[budget_id][0]) for budget_id, _, _ in held)
        return HoldPlan(periods, holds, stop)

    def admitting(
        self, chain: Chain | None, body: Callable[[Cursor, HoldPlan | None, datetime], T]
    ) -> T:
        """``body`` in one transaction, given the chain's admitting periods, found before
        it began (opening a period is a transaction of its own). Once more if a period
        turns out closed: this host's clock is behind a period another host opened, and
        admission goes to that later period. Every admission (a direct reservation, a
        delivery's main call, a labelled call) goes through here."""
        for again in (False, True):
            now = self.now()
            found = None if chain is None else self.find_holds(chain, now)
            try:
                return self.deadlock_retried(partial(self.in_transaction, body, found, now))
            except rate_takes.RateShort as short:
                raise self.booked(short, now) from None
            except PeriodClosed:
                if again or chain is None:
                    raise
                self.forget_periods(budget_id for budget_id, _, _ in chain)
        raise AssertionError("unreachable")

    def booked(self, short: rate_takes.RateShort, now: datetime) -> RateWindowFull:
        """What a call whose rate window was short is told: booked in each window's
        line (in a transaction of its own, the admission's having rolled back), or
        already booked there, and when its turn comes, as the windows stand now."""
        claim = short.claim
        try:
            turn = self.deadlock_retried(partial(self._book, short, epoch_ms(now)))
        except rate_takes.Unbooked as unbooked:  # it rolled back
            turn = unbooked.turn
        return RateWindowFull(claim.provider, turn.scope, turn.kind, turn.wait_ms, short.key)

    def _book(self, short: rate_takes.RateShort, now_ms: int) -> rate_takes.Turn:
        with self.driver.transaction() as cur:
            return rate_takes.book_in(cur, short.claim, short.key, now_ms, short.budgets)

    def rate_turn(self, key: str) -> rate_takes.Turn | None:
        """When the call booked under ``key`` has its turn, as its windows stand now
        (None: nothing is booked under it). A read: nothing is taken or written."""
        with self.driver.transaction() as cur:
            return rate_takes.turn_in(cur, key, epoch_ms(self.now()))

    def sent_alone(self, statement: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """A call of one of the server-side functions (:mod:`.functions`), sent alone: its
        row; None where it declined (nothing was written: the caller runs the
        statement path). A database without the functions (dropped, or never made by
        a role that may not) is told once, and then sent the statements only; those
        need this release's schema (``db upgrade`` before the workers start)."""
        try:
            row = self.driver.call(statement, params)
        except Declined as declined:
            if declined.sqlstate == functions.UNDEFINED_FUNCTION:
                log.warning(
                    "the ledger's database lacks its functions: run `budget-tasks db upgrade`"
                )
                self.use_functions = False
            elif declined.sqlstate.startswith(functions.BROKEN_TEXT):
                # the statement path still decides every case, only slower: said loudly,
                # for a function whose text names what the schema does not have
                log.error(
                    "a ledger function failed with SQLSTATE %s (its text does not fit this "
                    "database's schema): the statements run instead; run `budget-tasks db "
                    "upgrade`",
                    declined.sqlstate,
                )
            return None
        assert row is not None
        return row

    def settled_alone(
        self,
        key: str,
        actual: int,
        stamp: Any,
        *,
        estimate_only: bool = False,
        note: str | None = None,
        answered: Answered = NOTHING_ANSWERED,
        operation_id: int | None = None,
        owner: str | None = None,
        result: str | None = None,
        record: str | None = None,
        answer: str | None = None,
    ) -> bool:
        """A settlement of a ``sending`` attempt as one function call (see
        :mod:`.functions`); with ``operation_id``, its operation ends succeeded with
        ``result`` under ``owner``'s lease, in the same statement (and, with
        ``record``, the call's ``answer`` is stored under it for replay). False where
        the function declined: nothing was written, the statement path decides."""
        settled = self.sent_alone(
            functions.FINISH,
            {
                "operation_id": operation_id,
                "owner": owner,
                "key": key,
                "actual": actual,
                "estimate_only": estimate_only,
                "note": None if note is None else redact(note),
                **answered.params(),
                **answered.rate_params(),
                "now_ms": epoch_ms(self.now()),
                "result": result,
                "now": stamp,
                "record": record,
                "answer": answer,
            },
        )
        if settled is None:
            return False
        if actual > settled[0]:
            self.log_overrun(key, int(settled[0]), actual)
        return True

    def in_batches(self, statement: str, params: dict[str, Any]) -> int:
        """Run ``statement`` (one batch of ``params["batch"]`` rows) until a batch is
        short, each batch committed; the rows it changed."""
        done = 0
        while True:
            with self.driver.transaction() as cur:
                changed = cur.run(statement, params)
            done += changed
            if changed < params["batch"]:
                return done

    def in_transaction(
        self,
        body: Callable[[Cursor, HoldPlan | None, datetime], T],
        found: HoldPlan | None,
        now: datetime,
    ) -> T:
        with self.driver.transaction() as cur:
            return body(cur, found, now)

    @staticmethod
    def deadlock_retried(run: Callable[[], T]) -> T:
        """``run`` (one whole transaction), again after a short random wait if
        PostgreSQL aborted it to break a deadlock: the abort rolled back everything it
        wrote, so running it again is the documented remedy. Escrow locks a budget's
        period rows in one order, but the foreign-key checks made at COMMIT take key
        locks outside it; a cycle between them is rare, and it is never the caller's."""
        for attempt in range(DEADLOCK_RETRIES + 1):
            try:
                return run()
            except LedgerUnavailable as exc:
                if attempt == DEADLOCK_RETRIES or not _deadlocked(exc):
                    raise
                log.warning("a ledger transaction was chosen to break a deadlock: run again")
                time.sleep(random.uniform(0.0, 0.02 * (attempt + 1)))
        raise AssertionError("unreachable")

    def reserve_in(
        self,
        cur: Cursor,
        chain: Chain,
        found: HoldPlan,
        row: dict[str, Any],
        now: datetime,
        call: CallFacts | None = None,
        before_money: Callable[[], None] | None = None,
    ) -> Reservation:
        """Reserve in the caller's transaction, in the periods ``found`` by
        :meth:`find_holds` before it began (opening a period is a transaction of its own).
        With ``call``, the attempt is granted its send at once (state ``sending``) and
        described as ``call``: admission, grant and description are one commit.
        ``before_money`` runs after the call's rate windows are taken and before its
        budget rows are (what the caller writes to budget rows in this transaction:
        every rate window is locked before any budget row, in every writer)."""
        key, amount, reason = row["key"], row["amount"], row["reason"]
        periods, holds = found.periods, found.holds
        # A slice's attempt is its owner's: reads, replays and conflicts name the owner.
        # Its row names the slice, so that concurrent commits check references to
        # different budget rows (one row's many key-share lockers make MultiXacts).
        owner = self.owner_of(chain)
        names = {budget_id: name for budget_id, name, _ in chain}
        stamp = self.driver.ts(now)
        granted = call is not None
        # The attempt row goes first: a key that exists stops here, before any hold.
        inserted = cur.one(
            sql.INSERT_ATTEMPT,
            {
                **row,
                "period_id": periods[chain[0][0]][0],
                "now": stamp,
                "state": "sending" if granted else "reserved",
                "sending_at": stamp if granted else None,
                "lookup": call.lookup if call is not None else None,
                "model": call.model if call is not None else None,
                "timeout_ms": call.timeout_ms if call is not None else None,
                "request_digest": call.request if call is not None else None,
                **bound_params(call),
            },
        )
        if inserted is None:
            return self.existing(cur, key, owner, amount, row["fingerprint"])
        for _, period_id in holds:
            _journal(cur, inserted[0], period_id, "hold", amount, 0, reason, stamp)
        if call is not None and call.rate is not None:
            # the rate windows before the budget rows, which are locked last
            try:
                rate_takes.take_in(cur, call.rate, key, epoch_ms(now), self.tenants_of(chain))
            except rate_takes.RateShort:
                # a call its budget refuses is refused, not booked ahead of those
                # that can pay (the transaction rolls back either way)
                if before_money is not None:
                    before_money()
                self.admit_in(cur, found, amount, names, stamp)
                raise
        if before_money is not None:
            before_money()
        self.admit_in(cur, found, amount, names, stamp)
        return made_now(owner, periods[chain[0][0]][1], row, call)

    @staticmethod
    def admit_in(
        cur: Cursor, found: HoldPlan, amount: int, names: dict[int, str], stamp: Any
    ) -> None:
        """Admit ``amount`` in each (budget, period) the admission holds in, each checked
        and written by one conditional UPDATE (the escrowed one within its grant,
        drawing first if it is short); a refusal raises (the caller rolls back)."""
        # The budget rows are the contended ones: lock them last, just before COMMIT.
        stop = found.escrow
        for budget_id, period_id in found.holds:
            if stop is not None and budget_id == stop.budget_id:
                escrow.admit(cur, stop, found.periods, amount, stamp)
                continue
            admit = {"amount": amount, "period_id": period_id, "false": False}
            if cur.one(sql.ADMIT, admit):
                continue
            # what escrowed budgets under it hold unused is its to admit: take it back
            if escrow.reclaim_under(cur, budget_id, stamp) and cur.one(sql.ADMIT, admit):
                continue
            refusal = cur.one(sql.REFUSAL, {"period_id": period_id})
            available, frozen, closed = refusal or (0, True, None)
            if closed is not None:
                raise PeriodClosed(period_id)
            if frozen:
                raise BudgetFrozen(names[budget_id])
            raise BudgetExceeded(names[budget_id], amount, int(available))

    def existing(
        self,
        cur: Cursor,
        key: str,
        budget: str,
        amount: int,
        fingerprint: str | None,
    ) -> Reservation:
        row = cur.one(sql.EXISTING_ATTEMPT, {"key": key})
        assert row is not None  # the insert met this key under the same lock
        recorded_budget, recorded_amount, recorded_fp, state, reason, start = row
        for field, recorded, requested in (
            ("budget", recorded_budget, budget),
            ("amount", recorded_amount, amount),
            ("fingerprint", recorded_fp, fingerprint),
        ):
            if recorded != requested:
                raise IdempotencyConflict(key, field, recorded, requested)
        return Reservation(
            key, budget, amount, self.driver.from_ts(start), state, reason, fingerprint, False
        )

    def mark_unknown_in(
        self,
        cur: Cursor,
        key: str,
        reason: str,
        recorded_actual: int | None,
        answered: Answered = NOTHING_ANSWERED,
        *,
        untrusted: bool = False,
    ) -> bool:
        params = {
            "key": key,
            "note": redact(reason),
            "lookup": UNTRUSTED_LOOKUP if untrusted else None,
            "recorded": recorded_actual,
            **answered.params(),
        }
        if cur.one(sql.MARK_UNKNOWN, params) is not None:
            log.warning("attempt %s outcome unknown, its hold kept: %s", key, params["note"])
            # the vendor may have counted all it took: nothing goes back
            rate_takes.give_back_in(cur, key, epoch_ms(self.now()), None, answered.seen)
            return True
        state = cur.one(sql.ATTEMPT_STATE, {"key": key})
        if state is None:
            raise UnknownAttempt(key)
        if state[0] != "unknown":
            raise InvalidTransition(key, state[0], "mark unknown")
        return False

    def log_overrun(self, key: str, amount: int, actual: int) -> None:
        log.warning(
            "overrun on attempt %s: reserved %d, charged %d (+%d)",
            key,
            amount,
            actual,
            actual - amount,
        )

    def release_in(
        self,
        cur: Cursor,
        key: str,
        note: str,
        stamp: Any,
        *,
        expected: str | None = None,
        journal_note: str | None = None,
        seen: RateSeen | None = None,
    ) -> Resolution:
        return self.resolve_in(
            cur,
            key,
            0,
            "released",
            "release",
            note,
            stamp,
            expected=expected,
            journal_note=journal_note,
            answered=Answered(seen=seen),
        )

    def resolve(
        self,
        key: str,
        actual: int,
        state: str,
        kind: str,
        note: str | None,
        *,
        estimate_only: bool = False,
        expected: str | None = None,
        answered: Answered = NOTHING_ANSWERED,
    ) -> tuple[bool, int]:
        stamp = self.driver.ts(self.now())
        with self.driver.transaction() as cur:
            resolution = self.resolve_in(
                cur,
                key,
                actual,
                state,
                kind,
                note,
                stamp,
                estimate_only=estimate_only,
                expected=expected,
                answered=answered,
            )
            resolution.apply(cur)
        return resolution.applied, resolution.amount

    def resolve_in(
        self,
        cur: Cursor,
        key: str,
        actual: int,
        state: str,
        kind: str,
        note: str | None,
        stamp: Any,
        *,
        estimate_only: bool = False,
        expected: str | None = None,
        if_resolved: str = "raise",
        answer: str | None = None,
        answered: Answered = NOTHING_ANSWERED,
        actor: str | None = None,
        journal_note: str | None = None,
    ) -> Resolution:
        """Journal and resolve the attempt (compare-and-set on the state read under its
        row lock); the caller applies the counters last. ``if_resolved="top_up"``: an
        attempt resolved meanwhile (by reconciliation, an operator) keeps its charge,
        raised to ``actual`` by an adjustment entry if that is more; a run's proof of
        billing is never lost to an earlier resolution."""
        # Whatever a caller says of an attempt is stored without the credentials an
        # error may quote (the delivery's own errors are redacted already).
        note = None if note is None else redact(note)
        journal_note = None if journal_note is None else redact(journal_note)
        rows = cur.all(sql.LOCK_ATTEMPT, {"key": key})
        if not rows:
            raise UnknownAttempt(key)
        attempt_id, amount, charged, current, recorded_usage, _ = rows[0]
        periods = [period_id for *_, period_id in rows]
        if current in ("settled", "released"):
            if charged == actual:
                return Resolution(False, amount, actual, [], key)
            if if_resolved != "top_up":
                raise SettlementConflict(key, charged, actual)
            if actual > charged:
                why = f"a run reported {actual} after the attempt was {current} at {charged}"
                _top_up(cur, attempt_id, periods, actual - charged, why, stamp)
                log.warning("attempt %s: %s; +%d as an adjustment", key, why, actual - charged)
            return Resolution(False, amount, charged, [], key)
        if expected is not None and current != expected:
            raise InvalidTransition(key, current, f"{state} it as {expected} (it changed)")
        if not attempt_may(current, state):
            raise InvalidTransition(key, current, f"move it to {state} (it was never sent)")
        if recorded_usage is not None and actual < recorded_usage:
            raise UsageRecorded(key, recorded_usage, actual)
        for period_id in periods:
            _journal(
                cur,
                attempt_id,
                period_id,
                kind,
                -amount,
                actual,
                journal_note or note,
                stamp,
                actor=actor,
            )
        resolved = {"state": state, "actual": actual, "note": note, "answer": answer}
        done = cur.run(
            sql.RESOLVE_ATTEMPT,
            {
                **resolved,
                "now": stamp,
                "estimate_only": estimate_only,
                "attempt_id": attempt_id,
                "expected": current,
                **answered.params(),
            },
        )
        assert done == 1  # the row is locked (SQLite: the whole database is)
        # a settled call's uncounted tokens go back to its rate windows, a released
        # one's every token (its request stays counted); the budget rows come last
        counted = answered.counted if state == "settled" else RateAsk(0)
        rate_takes.give_back_in(cur, key, epoch_ms(self.now()), counted, answered.seen)
        return Resolution(True, int(amount), actual, periods, key, stamp)


def _top_up(
    cur: Cursor, attempt_id: int, periods: list[int], delta: int, why: str, stamp: Any
) -> None:
    """Raise a resolved attempt's charge by ``delta``, as an adjustment in each period."""
    for period_id in periods:
        _journal(cur, attempt_id, period_id, "adjustment", 0, delta, why, stamp)
        _apply(cur, sql.APPLY_ADJUSTMENT, {"delta": delta, "period_id": period_id}, stamp)


def bound_params(call: CallFacts | None) -> dict[str, int | None]:
    bound = call.bound if call is not None else None
    return {
        "input_bound": bound.input_tokens if bound is not None else None,
        "output_bound": bound.output_tokens if bound is not None else None,
    }


@dataclass(frozen=True, slots=True)
class Resolution:
    """A settlement written to the journal, whose counters are still to be applied."""

    applied: bool
    amount: int
    actual: int
    periods: list[int]
    key: str = ""
    stamp: Any = None

    def apply(self, cur: Cursor) -> None:
        # The budget rows are the contended ones: lock them last, just before COMMIT.
        for period_id in self.periods:
            _apply(
                cur,
                sql.APPLY_SETTLEMENT,
                {"amount": self.amount, "actual": self.actual, "period_id": period_id},
                self.stamp,
            )


def attempt_of(r: Row[Any]) -> Attempt:
    return Attempt(
        key=r.key,
        budget=r.budget,
        amount=r.amount,
        actual=r.actual,
        state=r.state,
        reason=r.reason,
        fingerprint=r.fingerprint,
        provider=r.provider,
        request_id=r.request_id,
        note=r.note,
        period_start=r.period_start,
        created_at=r.created_at,
        sending_at=r.sending_at,
        resolved_at=r.resolved_at,
        price_version=r.price_version,
        label=r.label,
        estimate_only=bool(r.estimate_only),
        lookup=r.lookup,
        model=r.model,
        response_id=r.response_id,
        lookups=r.lookups,
        flagged_at=r.flagged_at,
        operation_key=r.operation_key,
        recorded_actual=r.recorded_actual,
        step=r.step,
        timeout_ms=r.timeout_ms,
        request_digest=r.request_digest,
        input_bound=r.input_bound,
        output_bound=r.output_bound,
        input_tokens=r.input_tokens,
        output_tokens=r.output_tokens,
        credential=r.credential,
        answered_by=r.answered_by,
    )


def epoch_ms(moment: datetime) -> int:
    """``moment`` in milliseconds since the epoch: the rate windows' clock."""
    return math.floor(moment.timestamp() * 1000)
