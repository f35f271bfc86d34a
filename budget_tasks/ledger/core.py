"""The reservation ledger: reserve before sending, settle with real usage.

No Celery here. Every method runs in one short transaction; a failure to reach the
database raises :class:`LedgerUnavailable` and writes nothing (fail closed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Row,
    and_,
    case,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from .. import _validate as check
from ..errors import (
    BudgetExceeded,
    BudgetExists,
    BudgetFrozen,
    CapBelowCommitted,
    IdempotencyConflict,
    InvalidTransition,
    LedgerUnavailable,
    SettlementConflict,
    UnknownAttempt,
    UnknownBudget,
    UnknownOperation,
    UsageRecorded,
)
from . import statements as sql
from .engine import build_engine, transaction
from .maintenance import MaintenanceMixin
from .operations import OperationsMixin
from .periods import (
    PERIODS,
    RENEWALS,
    Period,
    PeriodClosed,
    Renewal,
    opening_cap,
    period_start,
    previous_period_start,
)
from .records import (
    Attempt,
    AuditFinding,
    Balance,
    BudgetInfo,
    BudgetReport,
    CallFacts,
    Hold,
    Reservation,
)
from .schema import (
    ATTEMPT_REASONS,
    HOLDING_STATES,
    UTCDateTime,
    attempts,
    budget_periods,
    budgets,
    journal,
    metadata,
    operations,
)
from .statements import Cursor, Driver
from .states import attempt_may

log = logging.getLogger("budget_tasks.ledger")

Clock = Callable[[], datetime]


#: How often the ledger measures this host's clock against the database's.
CLOCK_CHECK_SECONDS = 60.0
#: A difference between the clocks smaller than this is taken for none.
CLOCK_AGREEMENT = timedelta(milliseconds=50)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Ledger(OperationsMixin, MaintenanceMixin):
    """A budget ledger on PostgreSQL (``postgresql+psycopg://...``) or SQLite.

    ``clock`` returns the current time as an aware datetime; tests pass their own to
    move between periods.
    """

    def __init__(self, url: str, *, clock: Clock | None = None, **engine_options: Any) -> None:
        self.engine = build_engine(url, **engine_options)
        self.url = self.engine.url.render_as_string(hide_password=True)
        self._clock = clock
        #: The database's clock minus this host's, measured now and then: the ledger
        #: keeps time by the database, so that hosts whose clocks disagree still agree
        #: on which period a reservation falls in.
        self._offset: timedelta | None = None
        self._offset_at = 0.0
        self._lock = threading.Lock()
        # Budgets are never deleted or re-parented, and period rows never move, so
        # their ids are safe to cache for the life of the process.
        self._chains: dict[str, tuple[tuple[int, str, str], ...]] = {}
        self._period_ids: dict[tuple[int, datetime], tuple[int, datetime]] = {}
        self._dialect = self.engine.dialect.name
        self._driver = Driver(self.engine)

    def __repr__(self) -> str:
        return f"Ledger({self.url!r})"

    def dispose(self) -> None:
        """Close this ledger's database connections."""
        self._driver.close()
        self.engine.dispose()

    def create_schema(self) -> None:
        """Create the ledger tables if missing (tests, the embedded SQLite default).

        Production PostgreSQL uses the migrations: ``budget-tasks db upgrade``.
        """
        with transaction(self.engine) as conn:
            metadata.create_all(conn)

    def now(self) -> datetime:
        """The current time: the ``clock`` given, else the database's (this host's
        clock corrected by its offset from the database, measured every minute)."""
        if self._clock is None:
            return self._database_now()
        now = self._clock()
        if now.tzinfo is None:
            raise ValueError("the ledger clock must return timezone-aware datetimes")
        return now.astimezone(UTC)

    def _database_now(self) -> datetime:
        local = _utcnow()
        if self._dialect == "sqlite":
            return local  # the database is a file on this host: its clock is this one
        since = time.monotonic() - self._offset_at
        if self._offset is None or since > CLOCK_CHECK_SECONDS:
            try:
                with transaction(self.engine) as conn:  # connected (and pinged) first
                    before = _utcnow()
                    # clock_timestamp(): the time of this statement, not of the
                    # transaction's start; halfway through the round trip, the error is
                    # half of one round trip.
                    theirs = conn.execute(select(func.clock_timestamp())).scalar_one()
                    after = _utcnow()
                offset = theirs.astimezone(UTC) - (before + (after - before) / 2)
                # Below what one measurement can tell apart, the clocks agree: keep this
                # host's time (stamps then order with this host's other clocks).
                self._offset = offset if abs(offset) > CLOCK_AGREEMENT else timedelta(0)
                self._offset_at = time.monotonic()
            except LedgerUnavailable:
                if self._offset is None:
                    raise
        assert self._offset is not None
        return local + self._offset

    # -- budgets ---------------------------------------------------------------------

    def create_budget(
        self,
        name: str,
        cap: int,
        *,
        period: Period = "none",
        parent: str | None = None,
        tenant: str | None = None,
        renewal: Renewal = "reset",
        rollover_ceiling: int | None = None,
    ) -> BudgetInfo:
        """Create a budget with ``cap`` minor units per period.

        ``renewal`` is the written policy for what is left when a period ends:
        ``reset`` or ``rollover`` (carry the unused amount, the cap never above
        ``rollover_ceiling``, default 3x ``cap``).
        """
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        check.money(cap, "cap")
        if period not in PERIODS:
            raise ValueError(f"period must be one of {PERIODS}, not {period!r}")
        if renewal not in RENEWALS:
            raise ValueError(f"renewal must be one of {RENEWALS}, not {renewal!r}")
        check.optional_text(tenant, "tenant", max_length=check.MAX_NAME_LENGTH)
        if rollover_ceiling is not None:
            check.money(rollover_ceiling, "rollover_ceiling")
            if renewal != "rollover":
                raise ValueError("rollover_ceiling only applies to renewal='rollover'")
            if rollover_ceiling < cap:
                raise ValueError(f"rollover_ceiling {rollover_ceiling} is below the cap {cap}")
        if period == "none" and renewal != "reset":
            raise ValueError("a budget with period='none' never renews: use renewal='reset'")
        with transaction(self.engine) as conn:
            parent_id = None
            if parent is not None:
                check.text(parent, "parent", max_length=check.MAX_NAME_LENGTH)
                parent_id = conn.execute(
                    select(budgets.c.id).where(budgets.c.name == parent)
                ).scalar()
                if parent_id is None:
                    raise UnknownBudget(parent)
            try:
                with conn.begin_nested():
                    conn.execute(
                        insert(budgets).values(
                            name=name,
                            tenant=tenant,
                            parent_id=parent_id,
                            cap=cap,
                            period=period,
                            renewal=renewal,
                            rollover_ceiling=rollover_ceiling,
                            frozen=False,
                            created_at=self.now(),
                        )
                    )
            except IntegrityError as exc:
                raise BudgetExists(name) from exc
        return self.budget(name)

    def budget(self, name: str) -> BudgetInfo:
        """A budget's configuration. Raises UnknownBudget."""
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        for info in self._budget_rows(budgets.c.name == name):
            return info
        raise UnknownBudget(name)

    def budgets(self) -> list[BudgetInfo]:
        """Every budget, by name."""
        return self._budget_rows(literal(True))

    def _budget_rows(self, where: ColumnElement[bool]) -> list[BudgetInfo]:
        parent = budgets.alias("parent")
        query = (
            select(budgets, parent.c.name.label("parent_name"))
            .outerjoin(parent, parent.c.id == budgets.c.parent_id)
            .where(where)
            .order_by(budgets.c.name)
        )
        with transaction(self.engine) as conn:
            rows = conn.execute(query).all()
        return [
            BudgetInfo(
                id=r.id,
                name=r.name,
                cap=r.cap,
                period=r.period,
                renewal=r.renewal,
                rollover_ceiling=r.rollover_ceiling,
                tenant=r.tenant,
                parent=r.parent_name,
                frozen=r.frozen,
            )
            for r in rows
        ]

    def set_cap(self, name: str, cap: int, *, note: str | None = None) -> BudgetInfo:
        """Change a budget's cap (its allowance per period). The current open period's
        cap moves by the same amount (what it carried stays); the change is a journal
        entry (kind ``cap``). Lowering it below what that period has spent and holds is
        refused (CapBelowCommitted): that money is committed; freeze the budget to stop
        admissions. A rollover budget's ceiling is never below its cap."""
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        check.money(cap, "cap")
        check.optional_text(note, "note", max_length=10_000)
        now = self.now()
        budget_id, _, period = self._chain(name)[0]
        self._period_id(budget_id, period_start(period, now))  # type: ignore[arg-type]
        stamp = self._driver.ts(now)
        with self._driver.transaction() as cur:
            row = cur.one(sql.LOCK_BUDGET, {"name": name})
            if row is None:
                raise UnknownBudget(name)
            budget_id, old, ceiling = row
            if ceiling is not None and cap > ceiling:
                raise ValueError(f"cap {cap} is above budget {name!r}'s rollover ceiling {ceiling}")
            delta = cap - old
            current = cur.one(sql.LOCK_OPEN_PERIOD, {"budget_id": budget_id})
            if current is not None:
                period_id, period_cap, committed = current
                if period_cap + delta < committed:
                    raise CapBelowCommitted(name, cap, int(committed))
            cur.run(sql.SET_BUDGET_CAP, {"cap": cap, "budget_id": budget_id})
            if current is not None and delta:
                cur.run(sql.MOVE_PERIOD_CAP, {"delta": delta, "period_id": period_id})
                cur.run(
                    sql.INSERT_CAP_CHANGE,
                    {
                        "period_id": period_id,
                        "delta": delta,
                        "note": note or f"cap {old} -> {cap}",
                        "now": stamp,
                    },
                )
        log.info("budget %s: cap %d -> %d", name, old, cap)
        return self.budget(name)

    def freeze(self, name: str) -> None:
        """Stop all admission on this budget and its descendants; settlement goes on."""
        self._set_frozen(name, True)

    def unfreeze(self, name: str) -> None:
        self._set_frozen(name, False)

    def _set_frozen(self, name: str, frozen: bool) -> None:
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        with transaction(self.engine) as conn:
            done = conn.execute(
                update(budgets).where(budgets.c.name == name).values(frozen=frozen)
            ).rowcount
        if not done:
            raise UnknownBudget(name)

    def _chain(self, name: str) -> tuple[tuple[int, str, str], ...]:
        """(id, name, period) of the budget and each ancestor, the budget first."""
        chain = self._chains.get(name)
        if chain is not None:
            return chain
        with transaction(self.engine) as conn:
            found: list[tuple[int, str, str]] = []
            row = conn.execute(
                select(budgets.c.id, budgets.c.name, budgets.c.period, budgets.c.parent_id).where(
                    budgets.c.name == name
                )
            ).first()
            if row is None:
                raise UnknownBudget(name)
            while row is not None:
                found.append((row.id, row.name, row.period))
                if row.parent_id is None:
                    break
                row = conn.execute(
                    select(
                        budgets.c.id, budgets.c.name, budgets.c.period, budgets.c.parent_id
                    ).where(budgets.c.id == row.parent_id)
                ).first()
        chain = tuple(found)
        with self._lock:
            self._chains[name] = chain
        return chain

    # -- periods ---------------------------------------------------------------------

    def _period_id(self, budget_id: int, start: datetime) -> tuple[int, datetime]:
        """The id and start of the period admission uses when the clock says ``start``:
        that period, opened if new (closing every earlier one first); or, if a later
        period is open already (this host's clock is behind), that later one."""
        cached = self._period_ids.get((budget_id, start))
        if cached is not None:
            return cached
        with transaction(self.engine) as conn:
            found = self._open_period(conn, budget_id, start)
        with self._lock:
            self._period_ids[(budget_id, start)] = found
        return found

    def _forget_periods(self, budget_ids: Iterable[int]) -> None:
        ids = set(budget_ids)
        with self._lock:
            for slot in [slot for slot in self._period_ids if slot[0] in ids]:
                del self._period_ids[slot]

    def _open_period(
        self, conn: Connection, budget_id: int, start: datetime
    ) -> tuple[int, datetime]:
        p = budget_periods.c
        latest = conn.execute(
            select(p.id, p.period_start)
            .where(p.budget_id == budget_id, p.period_start >= start)
            .order_by(p.period_start.desc())
            .limit(1)
        ).first()
        if latest is not None:
            return int(latest.id), latest.period_start
        b = conn.execute(select(budgets).where(budgets.c.id == budget_id)).one()
        # Close before carrying (compare-and-set on closed_at): once closed, a period
        # admits nothing, so what it leaves unused cannot be spent there and carried too.
        closed = conn.execute(
            update(budget_periods)
            .where(p.budget_id == budget_id, p.period_start < start, p.closed_at.is_(None))
            .values(closed_at=self.now())
            .returning(p.id, p.period_start, p.cap, p.spent, p.held)
        ).all()
        prev_start = previous_period_start(b.period, start)
        previous = next((r for r in closed if r.period_start == prev_start), None)
        cap = opening_cap(
            b.cap,
            b.renewal,
            b.rollover_ceiling,
            None if previous is None else (previous.cap, previous.spent, previous.held),
        )
        if previous is not None and cap > b.cap:
            conn.execute(
                update(budget_periods).where(p.id == previous.id).values(carried_out=cap - b.cap)
            )
        values = {
            "budget_id": budget_id,
            "period_start": start,
            "cap": cap,
            "spent": 0,
            "held": 0,
            "opened_at": self.now(),
            "carried_out": 0,
        }
        # Two openers may race: the loser's close finds nothing left to close (it
        # carries nothing), and the unique (budget_id, period_start) keeps the winner's.
        conn.execute(self._insert_ignore(budget_periods, ("budget_id", "period_start")), values)
        row = conn.execute(
            select(p.id).where(p.budget_id == budget_id, p.period_start == start)
        ).scalar_one()
        return int(row), start

    def open_period(self, budget: str, at: datetime | None = None) -> Balance:
        """Open (if not yet open) the budget's period containing ``at`` (default: now),
        closing the periods before it: the one just before carries what it left unused
        into it, by the budget's renewal policy."""
        check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        at = self.now() if at is None else check.moment(at, "at")
        budget_id, _, period = self._chain(budget)[0]
        self._period_id(budget_id, period_start(period, at))  # type: ignore[arg-type]
        return self.balance(budget, at=at)

    def _insert_ignore(self, table: Any, index: Sequence[str]) -> Any:
        dialect_insert = postgresql.insert if self._dialect == "postgresql" else sqlite.insert
        return dialect_insert(table).on_conflict_do_nothing(index_elements=list(index))

    # -- reservation -----------------------------------------------------------------

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
    ) -> Reservation:
        """Hold ``amount`` on ``budget`` and every ancestor for the attempt ``key``.

        Admits only if ``spent + held + amount <= cap`` in the current period of each
        budget in the chain, each checked and written by one conditional UPDATE, in
        budget-id order, in one transaction. Permission to send exists once this
        returns with ``created=True``. An existing key returns its reservation with
        ``created=False``; another budget, amount or fingerprint raises
        IdempotencyConflict. ``reason`` says why the attempt exists (first, redelivery,
        rate_limited_retry, unknown_resend, manual); ``price_version`` records the price
        table the amount was estimated from.
        """
        check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        check.text(key, "key")
        check.money(amount)
        check.optional_text(fingerprint, "fingerprint")
        check.optional_text(price_version, "price_version", max_length=64)
        check.optional_text(label, "label", max_length=100)
        check.optional_text(step, "step")
        if operation_id is not None:
            check.row_id(operation_id, "operation_id")
        if reason not in ATTEMPT_REASONS:
            raise ValueError(f"reason must be one of {ATTEMPT_REASONS}, not {reason!r}")
        chain = self._chain(budget)
        row = {
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
        try:
            return self._reserve(chain, row)
        except PeriodClosed:
            # This host's clock is behind a period that another host opened (closing
            # this one): admission goes to that later period.
            self._forget_periods(budget_id for budget_id, _, _ in chain)
            return self._reserve(chain, row)

    def _holds(
        self, chain: tuple[tuple[int, str, str], ...], now: datetime
    ) -> tuple[dict[int, tuple[int, datetime]], list[tuple[int, int]]]:
        """Each budget's admitting period at ``now``, and the (budget, period) pairs to
        hold in, in budget-id order (the order every writer locks them in)."""
        periods = {
            budget_id: self._period_id(budget_id, period_start(period, now))  # type: ignore[arg-type]
            for budget_id, _, period in chain
        }
        return periods, sorted((budget_id, found[0]) for budget_id, found in periods.items())

    def _reserve(self, chain: tuple[tuple[int, str, str], ...], row: dict[str, Any]) -> Reservation:
        now = self.now()
        holds = self._holds(chain, now)
        try:
            with self._driver.transaction() as cur:
                return self._reserve_in(cur, chain, holds, row, now)
        except self._driver.integrity as exc:
            if row["operation_id"] is None:
                raise
            # the one reference the caller gives: an operation that does not exist
            raise UnknownOperation(f"id {row['operation_id']}") from exc

    def _reserve_in(
        self,
        cur: Cursor,
        chain: tuple[tuple[int, str, str], ...],
        found: tuple[dict[int, tuple[int, datetime]], list[tuple[int, int]]],
        row: dict[str, Any],
        now: datetime,
        call: CallFacts | None = None,
    ) -> Reservation:
        """Reserve in the caller's transaction, in the periods ``found`` by
        :meth:`_holds` before it began (opening a period is a transaction of its own).
        With ``call``, the attempt is granted its send at once (state ``sending``) and
        described as ``call``: admission, grant and description are one commit."""
        key, amount, reason = row["key"], row["amount"], row["reason"]
        periods, holds = found
        names = {budget_id: name for budget_id, name, _ in chain}
        stamp = self._driver.ts(now)
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
            },
        )
        if inserted is None:
            return self._existing(cur, key, chain[0][1], amount, row["fingerprint"])
        for _, period_id in holds:
            _journal(cur, inserted[0], period_id, "hold", amount, 0, reason, stamp)
        # The budget rows are the contended ones: lock them last, just before COMMIT.
        for budget_id, period_id in holds:
            if cur.one(sql.ADMIT, {"amount": amount, "period_id": period_id, "false": False}):
                continue
            available, frozen, closed = cur.one(sql.REFUSAL, {"period_id": period_id}) or (
                0,
                True,
                None,
            )
            if closed is not None:
                raise PeriodClosed(period_id)
            if frozen:
                raise BudgetFrozen(names[budget_id])
            raise BudgetExceeded(names[budget_id], amount, int(available))
        start = periods[chain[0][0]][1]
        return Reservation(
            key,
            chain[0][1],
            amount,
            start,
            "sending" if granted else "reserved",
            reason,
            row["fingerprint"],
            True,
        )

    def _existing(
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
            key, budget, amount, self._driver.from_ts(start), state, reason, fingerprint, False
        )

    # -- attempt state ---------------------------------------------------------------

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

    def _mark_unknown_in(
        self,
        cur: Cursor,
        key: str,
        reason: str,
        recorded_actual: int | None,
        ids: tuple[str | None, str | None] = (None, None),
    ) -> bool:
        params = {
            "key": key,
            "note": reason,
            "recorded": recorded_actual,
            "request_id": ids[0],
            "response_id": ids[1],
        }
        if cur.one(sql.MARK_UNKNOWN, params) is not None:
            log.warning("attempt %s outcome unknown, its hold kept: %s", key, reason)
            return True
        state = cur.one(sql.ATTEMPT_STATE, {"key": key})
        if state is None:
            raise UnknownAttempt(key)
        if state[0] != "unknown":
            raise InvalidTransition(key, state[0], "mark unknown")
        return False

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

    # -- settlement ------------------------------------------------------------------

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
        applied, amount = self._resolve(
            key,
            actual,
            "settled",
            "charge",
            note,
            estimate_only=estimate_only,
            expected=expected,
            ids=_ids(request_id, response_id),
        )
        if applied and actual > amount:
            self._log_overrun(key, amount, actual)
        return applied

    def _log_overrun(self, key: str, amount: int, actual: int) -> None:
        log.warning(
            "overrun on attempt %s: reserved %d, charged %d (+%d)",
            key,
            amount,
            actual,
            actual - amount,
        )

    def release(self, key: str, reason: str, *, expected: str | None = None) -> bool:
        """Drop the hold without a charge (settle at 0). False if already released.

        Refused (UsageRecorded) for an attempt whose run recorded usage: a recorded
        actual is proof of billing."""
        check.text(key, "key")
        check.text(reason, "reason", max_length=10_000)
        return self._resolve(key, 0, "released", "release", reason, expected=expected)[0]

    def _release_in(self, cur: Cursor, key: str, note: str, stamp: Any) -> _Resolution:
        return self._resolve_in(cur, key, 0, "released", "release", note, stamp)

    def _resolve(
        self,
        key: str,
        actual: int,
        state: str,
        kind: str,
        note: str | None,
        *,
        estimate_only: bool = False,
        expected: str | None = None,
        ids: tuple[str | None, str | None] = (None, None),
    ) -> tuple[bool, int]:
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            resolution = self._resolve_in(
                cur,
                key,
                actual,
                state,
                kind,
                note,
                stamp,
                estimate_only=estimate_only,
                expected=expected,
                ids=ids,
            )
            resolution.apply(cur)
        return resolution.applied, resolution.amount

    def _resolve_in(
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
        ids: tuple[str | None, str | None] = (None, None),
    ) -> _Resolution:
        """Journal and resolve the attempt (compare-and-set on the state read under its
        row lock); the caller applies the counters last.

        ``if_resolved="top_up"``: an attempt resolved meanwhile (by reconciliation, an
        operator) keeps its charge, raised to ``actual`` by an adjustment entry if that
        is more; a run's proof of billing is never lost to an earlier resolution."""
        rows = cur.all(sql.LOCK_ATTEMPT, {"key": key})
        if not rows:
            raise UnknownAttempt(key)
        attempt_id, amount, charged, current, recorded_usage, _ = rows[0]
        periods = [period_id for *_, period_id in rows]
        if current in ("settled", "released"):
            if charged == actual:
                return _Resolution(False, amount, actual, [], key)
            if if_resolved == "top_up":
                if actual > charged:
                    delta = actual - charged
                    why = f"a run reported {actual} after the attempt was {current} at {charged}"
                    for period_id in periods:
                        _apply(cur, sql.APPLY_ADJUSTMENT, {"delta": delta, "period_id": period_id})
                        _journal(cur, attempt_id, period_id, "adjustment", 0, delta, why, stamp)
                    log.warning("attempt %s: %s; +%d as an adjustment", key, why, delta)
                return _Resolution(False, amount, charged, [], key)
            raise SettlementConflict(key, charged, actual)
        if expected is not None and current != expected:
            raise InvalidTransition(key, current, f"{state} it as {expected} (it changed)")
        if not attempt_may(current, state):
            raise InvalidTransition(key, current, f"move it to {state} (it was never sent)")
        if recorded_usage is not None and actual < recorded_usage:
            raise UsageRecorded(key, recorded_usage, actual)
        for period_id in periods:
            _journal(cur, attempt_id, period_id, kind, -amount, actual, note, stamp)
        done = cur.run(
            sql.RESOLVE_ATTEMPT,
            {
                "state": state,
                "actual": actual,
                "now": stamp,
                "note": note,
                "estimate_only": estimate_only,
                "answer": answer,
                "attempt_id": attempt_id,
                "expected": current,
                "request_id": ids[0],
                "response_id": ids[1],
            },
        )
        assert done == 1  # the row is locked (SQLite: the whole database is)
        return _Resolution(True, int(amount), actual, periods, key)

    def adjust(self, key: str, delta: int, reason: str, *, ref: str | None = None) -> bool:
        """Add a provider correction to a settled or released attempt's charge.

        Recorded as a new journal entry, never an overwrite, in the attempt's own
        periods. ``ref`` (e.g. the provider's invoice line id) makes the correction
        idempotent: a second call with the same ref returns False.
        """
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
            (charged,) = cur.one(sql.ATTEMPT_CHARGED, {"attempt_id": attempt_id}) or (0,)
            if charged + delta < 0:
                raise ValueError(
                    f"adjustment {delta} would take attempt {key!r} below zero (charged {charged})"
                )
            for *_, period_id in rows:
                _apply(cur, sql.APPLY_ADJUSTMENT, {"delta": delta, "period_id": period_id})
                _journal(cur, attempt_id, period_id, "adjustment", 0, delta, reason, stamp, ref)
        return True

    # -- reporting -------------------------------------------------------------------

    def balance(self, budget: str, *, at: datetime | None = None) -> Balance:
        """The budget's counters for the period containing ``at`` (default: now).

        A read opens nothing: for a period not open yet, it shows what the period would
        open with now (its renewal applied to the period before, as that stands)."""
        check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        at = self.now() if at is None else check.moment(at, "at")
        budget_id, name, period = self._chain(budget)[0]
        start = period_start(period, at)  # type: ignore[arg-type]
        cached = self._period_ids.get((budget_id, start))
        p = budget_periods.c
        period_id: int | None
        with transaction(self.engine) as conn:
            if cached is not None and cached[1] == start:
                period_id = cached[0]
            else:
                period_id = conn.execute(
                    select(p.id).where(p.budget_id == budget_id, p.period_start == start)
                ).scalar()
            if period_id is None:
                b = conn.execute(select(budgets).where(budgets.c.id == budget_id)).one()
                prev_start = previous_period_start(b.period, start)
                prev = None
                if prev_start is not None:
                    prev = conn.execute(
                        select(p.cap, p.spent, p.held).where(
                            p.budget_id == budget_id,
                            p.period_start == prev_start,
                            p.closed_at.is_(None),
                        )
                    ).first()
                cap = opening_cap(
                    b.cap,
                    b.renewal,
                    b.rollover_ceiling,
                    None if prev is None else (prev.cap, prev.spent, prev.held),
                )
                return Balance(name, cap, 0, 0, cap, start)
        with self._driver.transaction() as cur:
            row = cur.one(sql.BALANCE, {"period_id": period_id})
        assert row is not None
        cap, spent, held, free = row
        return Balance(name, cap, spent, held, free, start)

    def attempt(self, key: str) -> Attempt:
        """One attempt, with its state, amounts and provider ids."""
        check.text(key, "key")
        with transaction(self.engine) as conn:
            row = conn.execute(self._attempt_query().where(attempts.c.key == key)).first()
        if row is None:
            raise UnknownAttempt(key)
        return _attempt(row)

    def attempts(
        self,
        *,
        budget: str | None = None,
        states: Iterable[str] | None = None,
        keys: Iterable[str] | None = None,
    ) -> list[Attempt]:
        """Attempts, oldest first, optionally of one budget, in some states, by key."""
        query = self._attempt_query().order_by(attempts.c.id)
        if keys is not None:
            query = query.where(attempts.c.key.in_(list(keys)))
        if budget is not None:
            query = query.where(budgets.c.name == budget)
        if states is not None:
            query = query.where(attempts.c.state.in_(list(states)))
        with transaction(self.engine) as conn:
            return [_attempt(r) for r in conn.execute(query)]

    def holds(
        self,
        *,
        older_than: timedelta | None = None,
        states: Iterable[str] = HOLDING_STATES,
        budget: str | None = None,
        keys: Iterable[str] | None = None,
    ) -> list[Hold]:
        """Attempts still holding money, oldest first, each with its age."""
        states = tuple(states)
        if not set(states) <= set(HOLDING_STATES):
            raise ValueError(f"holds are in states {HOLDING_STATES}, not {states}")
        now = self.now()
        query = self._attempt_query().where(attempts.c.state.in_(states))
        if keys is not None:
            query = query.where(attempts.c.key.in_(list(keys)))
        if older_than is not None:
            check.duration(older_than, "older_than", allow_zero=True)
            query = query.where(attempts.c.created_at <= now - older_than)
        if budget is not None:
            query = query.where(budgets.c.name == budget)
        with transaction(self.engine) as conn:
            rows = conn.execute(query.order_by(attempts.c.created_at, attempts.c.id)).all()
        return [
            Hold(
                key=r.key,
                budget=r.budget,
                amount=r.amount,
                state=r.state,
                reason=r.reason,
                provider=r.provider,
                request_id=r.request_id,
                note=r.note,
                period_start=r.period_start,
                created_at=r.created_at,
                age=now - r.created_at,
                flagged_at=r.flagged_at,
            )
            for r in rows
        ]

    def _attempt_query(self) -> Any:
        return (
            select(
                attempts,
                budgets.c.name.label("budget"),
                budget_periods.c.period_start,
                operations.c.key.label("operation_key"),
            )
            .join(budgets, budgets.c.id == attempts.c.budget_id)
            .join(budget_periods, budget_periods.c.id == attempts.c.period_id)
            .outerjoin(operations, operations.c.id == attempts.c.operation_id)
        )

    def report(self) -> list[BudgetReport]:
        """Every budget's current period (cap, spent, held, available) and the age of
        its oldest open hold, in one set-based query: what a metrics scrape and
        ``budget-tasks status`` show. A period not open yet shows what it would open
        with; nothing is opened."""
        now = self.now()
        starts = {kind: period_start(kind, now) for kind in PERIODS}
        before = {kind: previous_period_start(kind, start) for kind, start in starts.items()}
        b = budgets.c
        cur, prev = budget_periods.alias("cur"), budget_periods.alias("prev")

        def by_kind(values: Mapping[Period, datetime | None]) -> Any:
            whens = {kind: literal(at, UTCDateTime()) for kind, at in values.items() if at}
            return case(whens, value=b.period, else_=None)

        oldest = (
            select(attempts.c.budget_id, func.min(attempts.c.created_at).label("oldest"))
            .where(attempts.c.state.in_(HOLDING_STATES))
            .group_by(attempts.c.budget_id)
            .subquery()
        )
        query = (
            select(
                b.name,
                b.cap,
                b.renewal,
                b.rollover_ceiling,
                b.frozen,
                b.period,
                cur.c.id.label("cur_id"),
                cur.c.cap.label("cur_cap"),
                cur.c.spent.label("cur_spent"),
                cur.c.held.label("cur_held"),
                cur.c.overrun.label("cur_overrun"),
                prev.c.cap.label("prev_cap"),
                prev.c.spent.label("prev_spent"),
                prev.c.held.label("prev_held"),
                oldest.c.oldest,
            )
            .select_from(
                budgets.outerjoin(
                    cur, and_(cur.c.budget_id == b.id, cur.c.period_start == by_kind(starts))
                )
                .outerjoin(
                    prev,
                    and_(
                        prev.c.budget_id == b.id,
                        prev.c.period_start == by_kind(before),
                        prev.c.closed_at.is_(None),
                    ),
                )
                .outerjoin(oldest, oldest.c.budget_id == b.id)
            )
            .order_by(b.name)
        )
        with transaction(self.engine) as conn:
            rows = conn.execute(query).all()
        out = []
        for r in rows:
            overrun = 0
            if r.cur_id is not None:
                cap, spent, held, overrun = r.cur_cap, r.cur_spent, r.cur_held, r.cur_overrun
            else:
                previous = None if r.prev_cap is None else (r.prev_cap, r.prev_spent, r.prev_held)
                cap = opening_cap(r.cap, r.renewal, r.rollover_ceiling, previous)
                spent = held = 0
            out.append(
                BudgetReport(
                    budget=r.name,
                    cap=cap,
                    spent=spent,
                    held=held,
                    available=cap - spent - held,
                    period_start=starts[r.period],
                    frozen=bool(r.frozen),
                    oldest_hold=None if r.oldest is None else now - r.oldest,
                    overrun=overrun,
                )
            )
        return out

    def audit(self) -> list[AuditFinding]:
        """Budget periods whose counters differ from their journal; empty when sound."""
        over = journal.c.spent_delta + journal.c.held_delta  # a charge above its hold
        sums = (
            select(
                journal.c.period_id,
                func.sum(journal.c.held_delta).label("held"),
                func.sum(journal.c.spent_delta).label("spent"),
                func.sum(case((and_(journal.c.kind == "charge", over > 0), over), else_=0)).label(
                    "overrun"
                ),
            )
            .group_by(journal.c.period_id)
            .subquery()
        )
        journal_held = func.coalesce(sums.c.held, 0)
        journal_spent = func.coalesce(sums.c.spent, 0)
        journal_overrun = func.coalesce(sums.c.overrun, 0)
        query = (
            select(
                budgets.c.name,
                budget_periods.c.period_start,
                budget_periods.c.held,
                budget_periods.c.spent,
                budget_periods.c.overrun,
                journal_held.label("journal_held"),
                journal_spent.label("journal_spent"),
                journal_overrun.label("journal_overrun"),
            )
            .join(budgets, budgets.c.id == budget_periods.c.budget_id)
            .outerjoin(sums, sums.c.period_id == budget_periods.c.id)
            .where(
                case(
                    (
                        and_(
                            budget_periods.c.held == journal_held,
                            budget_periods.c.spent == journal_spent,
                            budget_periods.c.overrun == journal_overrun,
                        ),
                        False,
                    ),
                    else_=True,
                )
            )
            .order_by(budgets.c.name, budget_periods.c.period_start)
        )
        findings = []
        with transaction(self.engine) as conn:
            for r in conn.execute(query):
                for counter, recorded, derived in (
                    ("held", r.held, r.journal_held),
                    ("spent", r.spent, r.journal_spent),
                    ("overrun", r.overrun, r.journal_overrun),
                ):
                    if recorded != derived:
                        findings.append(
                            AuditFinding(r.name, r.period_start, counter, recorded, int(derived))
                        )
        return findings


def _ids(request_id: str | None, response_id: str | None) -> tuple[str | None, str | None]:
    check.optional_text(request_id, "request_id")
    check.optional_text(response_id, "response_id", max_length=255)
    return request_id, response_id


def _journal(
    cur: Cursor,
    attempt_id: int,
    period_id: int,
    kind: str,
    held_delta: int,
    spent_delta: int,
    note: str | None,
    stamp: Any,
    ref: str | None = None,
) -> None:
    """Append one journal entry: the only way the counters' history is written."""
    cur.run(
        sql.INSERT_JOURNAL,
        {
            "attempt_id": attempt_id,
            "period_id": period_id,
            "kind": kind,
            "held_delta": held_delta,
            "spent_delta": spent_delta,
            "note": note,
            "ref": ref,
            "now": stamp,
        },
    )


@dataclass(frozen=True, slots=True)
class _Resolution:
    """A settlement written to the journal, whose counters are still to be applied."""

    applied: bool
    amount: int
    actual: int
    periods: list[int]
    key: str = ""

    def apply(self, cur: Cursor) -> None:
        # The budget rows are the contended ones: lock them last, just before COMMIT.
        for period_id in self.periods:
            _apply(
                cur,
                sql.APPLY_SETTLEMENT,
                {"amount": self.amount, "actual": self.actual, "period_id": period_id},
            )


def _apply(cur: Cursor, statement: str, params: dict[str, Any]) -> None:
    """Apply a change to a period's counters. If the period is closed and carried what
    it left unused, and the change leaves it less unused than it carried (an overrun
    settled late, a provider correction), the difference comes off the period it
    carried into: no money is spent in one period and carried into the next too."""
    row = cur.one(statement, params)
    period_id = params["period_id"]
    # A period that carried on what it received passes the take-back on in turn, until
    # a period that still had room for it (or the open one) absorbs it.
    while row is not None:
        carried, available = row[-2], row[-1]
        if carried <= 0 or available >= carried:
            return
        deficit = carried - max(available, 0)
        cur.run(sql.TAKE_BACK_CARRY, {"period_id": period_id, "deficit": deficit})
        log.warning(
            "period %s spent %d of what it carried into the next after closing: "
            "that amount comes off the next period's cap",
            period_id,
            deficit,
        )
        row = cur.one(sql.LOWER_NEXT_CAP, {"period_id": period_id, "deficit": deficit})
        if row is not None:
            period_id = row[0]


def _attempt(r: Row[Any]) -> Attempt:
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
    )
