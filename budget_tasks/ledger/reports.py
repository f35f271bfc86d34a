"""Reports: balances, attempts and holds, every budget's current period in one query,
and the audit of the counters against the journal."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    and_,
    case,
    func,
    literal,
    select,
)

from .. import _validate as check
from ..errors import (
    UnknownAttempt,
)
from . import statements as sql
from .base import LedgerBase, _attempt
from .driver import Cursor
from .periods import (
    PERIODS,
    Period,
    next_period_start,
    opening_cap,
    period_start,
    previous_period_start,
)
from .records import (
    Attempt,
    Balance,
    BudgetReport,
    Hold,
    SettledStats,
)
from .schema import (
    HOLDING_STATES,
    UTCDateTime,
    attempts,
    budget_periods,
    budgets,
    journal,
    operations,
)


def _holds_query() -> Any:
    """What :meth:`Reports.holds` reads: the holding attempts by their state's index,
    each with its budget (a slice's is its owner's) and its period's start looked up
    by key, so that the work follows the holds, never the history of periods."""
    owner = budgets.alias("owner")
    start = (
        select(budget_periods.c.period_start)
        .where(budget_periods.c.id == attempts.c.period_id)
        .scalar_subquery()
    )
    return (
        select(
            attempts.c.key,
            attempts.c.amount,
            attempts.c.state,
            attempts.c.reason,
            attempts.c.provider,
            attempts.c.request_id,
            attempts.c.note,
            attempts.c.created_at,
            attempts.c.flagged_at,
            func.coalesce(owner.c.name, budgets.c.name).label("budget"),
            start.label("period_start"),
        )
        .join_from(attempts, budgets, budgets.c.id == attempts.c.budget_id)
        .outerjoin(owner, owner.c.id == budgets.c.slice_of)
    )


def _report_query(
    starts: Mapping[Period, datetime | None], before: Mapping[Period, datetime | None]
) -> Any:
    """Each budget with its period at ``starts`` (by its kind of period), the one
    before it (``before``), what it would carry from, and the age of its oldest open hold."""
    b = budgets.c

    def at_starts(values: Mapping[Period, datetime | None], name: str) -> Any:
        # Only the rows at these few period starts, read through the index on
        # period_start: what the report reads stays one row per budget however many
        # periods the budgets had (a join on the computed start alone scans them all).
        wanted = sorted({at for at in values.values() if at is not None})
        return (
            select(budget_periods)
            .where(budget_periods.c.period_start.in_([literal(at, UTCDateTime()) for at in wanted]))
            .subquery(name)
        )

    cur, prev = at_starts(starts, "cur"), at_starts(before, "prev")

    def by_kind(values: Mapping[Period, datetime | None]) -> Any:
        whens = {kind: literal(at, UTCDateTime()) for kind, at in values.items() if at}
        return case(whens, value=b.period, else_=None)

    oldest = (
        select(attempts.c.budget_id, func.min(attempts.c.created_at).label("oldest"))
        .where(attempts.c.state.in_(HOLDING_STATES))
        .group_by(attempts.c.budget_id)
        .subquery()
    )
    return (
        select(
            b.id,
            b.slice_of,
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
            cur.c.granted.label("cur_granted"),
            cur.c.drawn.label("cur_drawn"),
            prev.c.cap.label("prev_cap"),
            (prev.c.spent + prev.c.granted).label("prev_spent"),
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
                ),
            )
            .outerjoin(oldest, oldest.c.budget_id == b.id)
        )
        .order_by(b.name)
    )


def _age(now: datetime, *oldest: datetime | None) -> timedelta | None:
    """The age of the oldest of the holds' creation times given (None: no hold)."""
    known = [at for at in oldest if at is not None]
    return now - min(known) if known else None


@dataclass(frozen=True, slots=True)
class _Below:
    """What the escrowed budgets under one budget (any depth: its slices, its tenants
    and theirs) have of their grants in its period, over the periods still in use."""

    unspent: int = 0  # drawn - spent
    held: int = 0
    unused: int = 0  # drawn - spent - held


Spans = Mapping[int, tuple[datetime, datetime | None]]


def _parents(cur: Cursor) -> dict[int, int]:
    """Each budget's parent: the tree a roll-up walks."""
    return {int(child): int(parent) for child, parent in cur.all(sql.BUDGET_PARENTS, {})}


def _ancestors_inside(
    parents: Mapping[int, int], budget_id: int, start: datetime, spans: Spans
) -> Iterator[int]:
    """The ancestors of ``budget_id`` whose span in ``spans`` contains ``start``."""
    above = parents.get(budget_id)
    while above is not None:
        span = spans.get(above)
        if span is not None and span[0] <= start and (span[1] is None or start < span[1]):
            yield above
        above = parents.get(above)


def _below(cur: Cursor, parents: Mapping[int, int], *spans: Spans) -> list[dict[int, _Below]]:
    """For each map of ``spans`` (a budget's id: its period's start and end, None for
    no end), what the escrowed budgets under each budget have in the periods inside
    that one; the periods in use are read once for all of them."""
    sums: list[dict[int, list[int]]] = [{} for _ in spans]
    for budget_id, start, spent, held, drawn in cur.all(sql.ESCROWED_IN_USE, {"true": True}):
        start = cur.driver.from_ts(start)
        for wanted, into in zip(spans, sums, strict=True):
            for above in _ancestors_inside(parents, int(budget_id), start, wanted):
                added = into.setdefault(above, [0, 0, 0])
                added[0] += drawn - spent
                added[1] += held
                added[2] += drawn - spent - held
    return [{b: _Below(*added) for b, added in into.items()} for into in sums]


def _overrun_below(cur: Cursor, parents: Mapping[int, int], spans: Spans) -> dict[int, int]:
    """What the escrowed budgets under each budget of ``spans`` were charged above
    their reservations in periods inside its one: without escrow the same charge is
    journalled in the budget's own period; with it, only in the tenant's."""
    if not spans:
        return {}
    since = cur.driver.ts(min(start for start, _ in spans.values()))
    sums: dict[int, int] = {}
    for budget_id, start, overrun in cur.all(sql.ESCROWED_OVERRUNS, {"true": True, "since": since}):
        for above in _ancestors_inside(parents, int(budget_id), cur.driver.from_ts(start), spans):
            sums[above] = sums.get(above, 0) + int(overrun)
    return sums


def _rolled(spent: int, held: int, granted: int, below: _Below) -> tuple[int, int, int]:
    """A budget's spent, held and granted with what the escrowed budgets under it spent
    and hold rolled in. Its ``granted`` is what they drew from it in this period: of
    that, the periods still in use hold ``below``, and every other one spent all it
    drew. What is left is what they hold of their grants unused: counted as available
    (an admission takes it back), shown as ``granted``."""
    return spent + granted - below.unspent, held + below.held, below.unused


def _span(kind: str, start: datetime) -> tuple[datetime, datetime | None]:
    return start, next_period_start(kind, start)  # type: ignore[arg-type]


class Reports(LedgerBase):
    """The reading methods of :class:`~budget_tasks.Ledger`."""

    def balance(self, budget: str, *, at: datetime | None = None) -> Balance:
        """The budget's counters for the period containing ``at`` (default: now).

        A read opens nothing: for a period not open yet, it shows what the period would
        open with now (its renewal applied to the period before, as that stands)."""
        check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        at = self.now() if at is None else check.moment(at, "at")
        budget_id, name, period = self._chain(budget)[0]
        start = period_start(period, at)  # type: ignore[arg-type]
        at_start = {"budget_id": budget_id, "start": self._driver.ts(start)}
        with self._driver.transaction() as cur:
            row = cur.one(sql.BALANCE_AT, at_start)
            below = _below(cur, _parents(cur), {budget_id: _span(period, start)})[0] if row else {}
            if row is None:
                renewal = cur.one(sql.BUDGET_RENEWAL, {"budget_id": budget_id})
                assert renewal is not None  # the chain named it
                kind, allowance, policy, ceiling = renewal
                prev_start = previous_period_start(kind, start)
                prev = None
                if prev_start is not None:
                    prev = cur.one(
                        sql.CARRY_FROM,
                        {"budget_id": budget_id, "start": self._driver.ts(prev_start)},
                    )
                counters = None
                if prev is not None:
                    # what its escrowed budgets hold unused comes back before it carries
                    assert prev_start is not None
                    [back] = _below(cur, _parents(cur), {budget_id: _span(kind, prev_start)})
                    unused = back.get(budget_id, _Below()).unused
                    counters = (prev[1], prev[2] - unused, prev[3])
                cap = opening_cap(allowance, policy, ceiling, counters)
                return Balance(name, cap, 0, 0, cap, start)
        cap, spent, held, _, granted, drawn = row
        spent, held, granted = _rolled(spent, held, granted, below.get(budget_id, _Below()))
        return Balance(name, cap, spent, held, cap - spent - held, start, granted, drawn)

    def attempt(self, key: str) -> Attempt:
        """One attempt, with its state, amounts and provider ids."""
        check.text(key, "key")
        with self._driver.transaction() as cur:
            row = cur.execute(self._attempt_query().where(attempts.c.key == key)).first()
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
            owner = query.selected_columns.budget
            query = query.where(owner == budget)
        if states is not None:
            query = query.where(attempts.c.state.in_(list(states)))
        with self._driver.transaction() as cur:
            return [_attempt(r) for r in cur.execute(query)]

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
        query = _holds_query().where(attempts.c.state.in_(states))
        if keys is not None:
            query = query.where(attempts.c.key.in_(list(keys)))
        if older_than is not None:
            check.duration(older_than, "older_than", allow_zero=True)
            query = query.where(attempts.c.created_at <= now - older_than)
        if budget is not None:
            owner = query.selected_columns.budget
            query = query.where(owner == budget)
        with self._driver.transaction() as cur:
            rows = cur.execute(query.order_by(attempts.c.created_at, attempts.c.id)).all()
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
        # a slice's attempt is its owner's
        owner = budgets.alias("owner")
        return (
            select(
                attempts,
                func.coalesce(owner.c.name, budgets.c.name).label("budget"),
                budget_periods.c.period_start,
                operations.c.key.label("operation_key"),
            )
            .join(budgets, budgets.c.id == attempts.c.budget_id)
            .outerjoin(owner, owner.c.id == budgets.c.slice_of)
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
        with self._driver.transaction() as tx:
            rows = tx.execute(_report_query(starts, before)).all()
            spans = {r.id: _span(r.period, starts[r.period]) for r in rows if r.cur_id is not None}
            # a period not open yet carries from the one before, once what the escrowed
            # budgets under it hold unused has come back
            carrying = {
                r.id: _span(r.period, before[r.period])  # type: ignore[arg-type]
                for r in rows
                if r.cur_id is None and r.prev_cap is not None
            }
            # one read of the periods in use for both
            parents = _parents(tx)
            below, back = _below(tx, parents, spans, carrying)
            overrun_below = _overrun_below(tx, parents, spans)
        # A sliced budget's slices are its own rows: rolled into it, never listed.
        oldest: dict[int, datetime] = {}
        for r in rows:
            if r.slice_of is not None and r.oldest is not None:
                was_oldest = oldest.get(r.slice_of)
                oldest[r.slice_of] = r.oldest if was_oldest is None else min(was_oldest, r.oldest)
        out = []
        for r in rows:
            if r.slice_of is not None:
                continue
            overrun = granted = drawn = 0
            if r.cur_id is not None:
                cap, spent, held = r.cur_cap, r.cur_spent, r.cur_held
                overrun = r.cur_overrun + overrun_below.get(r.id, 0)
                drawn = r.cur_drawn
                spent, held, granted = _rolled(
                    spent, held, r.cur_granted, below.get(r.id, _Below())
                )
            else:
                previous = None
                if r.prev_cap is not None:
                    unused = back.get(r.id, _Below()).unused
                    previous = (r.prev_cap, r.prev_spent - unused, r.prev_held)
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
                    oldest_hold=_age(now, r.oldest, oldest.get(r.id)),
                    overrun=overrun,
                    granted=granted,
                    drawn=drawn,
                )
            )
        return out


#: The buckets a spend series is summed in.
BUCKETS = ("hour", "day")
#: The most buckets one series returns (31 days of hours).
MAX_BUCKETS = 31 * 24


def _bucket_expr(dialect: str, bucket: str, column: Any) -> Any:
    """The start of ``column``'s hour or day in UTC, on each backend."""
    if dialect == "sqlite":
        # stored as UTC wall time (see UTCDateTime): text ordering is time ordering
        fmt = "%Y-%m-%d %H:00:00" if bucket == "hour" else "%Y-%m-%d 00:00:00"
        return func.strftime(fmt, column)
    return func.date_trunc(bucket, column, "UTC")


def _as_utc(value: Any) -> datetime:
    if isinstance(value, str):  # SQLite's strftime
        value = datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _current_periods(starts: Mapping[Period, datetime]) -> Any:
    """The budgets' periods at ``starts`` (by their kind of period), read by the index
    on period_start: one row per budget, not its history."""
    wanted = sorted(set(starts.values()))
    whens = {kind: literal(at, UTCDateTime()) for kind, at in starts.items()}
    return and_(
        budget_periods.c.period_start.in_([literal(at, UTCDateTime()) for at in wanted]),
        budget_periods.c.period_start == case(whens, value=budgets.c.period, else_=None),
    )


def _owner_name() -> tuple[Any, Any]:
    """A slice's rows are its owner's: (the owner alias, the name to report under)."""
    owner = budgets.alias("owner")
    return owner, func.coalesce(owner.c.name, budgets.c.name)


class Views(Reports):
    """What a dashboard reads besides the reports: spend over time from the journal,
    spend of the current periods since a moment, settled attempts against their
    estimates, and open attempts with a limit."""

    def spend_series(
        self, budget: str, *, since: datetime, until: datetime | None = None, bucket: str = "hour"
    ) -> list[tuple[datetime, int]]:
        """What ``budget`` was charged (its journal's spent deltas: charges and
        corrections, in any of its periods) in each hour or day from ``since`` to
        before ``until`` (default: no end), oldest first; buckets with nothing are left out.
        Read by the budget's periods (the journal's period index), at most
        :data:`MAX_BUCKETS` buckets."""
        check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        if bucket not in BUCKETS:
            raise ValueError(f"bucket must be one of {BUCKETS}, not {bucket!r}")
        since = check.moment(since, "since")
        if until is not None:
            until = check.moment(until, "until")
        self._chain(budget)  # an unknown budget is an error, not an empty series
        owner, name = _owner_name()
        periods = (
            select(budget_periods.c.id)
            .join(budgets, budgets.c.id == budget_periods.c.budget_id)
            .outerjoin(owner, owner.c.id == budgets.c.slice_of)
            .where(name == budget)
        )
        start = _bucket_expr(self._dialect, bucket, journal.c.created_at).label("bucket")
        query = (
            select(start, func.sum(journal.c.spent_delta).label("spent"))
            .where(journal.c.period_id.in_(periods))
            .where(journal.c.created_at >= literal(since, UTCDateTime()))
            .where(journal.c.spent_delta != 0)
            .group_by(start)
            .order_by(start)
            .limit(MAX_BUCKETS)
        )
        if until is not None:
            query = query.where(journal.c.created_at < literal(until, UTCDateTime()))
        with self._driver.transaction() as cur:
            rows = cur.execute(query).all()
        return [(_as_utc(r.bucket), int(r.spent)) for r in rows]

    def spend_since(self, since: datetime) -> dict[str, int]:
        """Each budget's spending in its current period since ``since`` (its journal's
        spent deltas), by budget name; budgets with none are left out."""
        since = check.moment(since, "since")
        now = self.now()
        starts = {kind: period_start(kind, now) for kind in PERIODS}
        owner, name = _owner_name()
        query = (
            select(name.label("budget"), func.sum(journal.c.spent_delta).label("spent"))
            .select_from(
                journal.join(budget_periods, budget_periods.c.id == journal.c.period_id)
                .join(budgets, budgets.c.id == budget_periods.c.budget_id)
                .outerjoin(owner, owner.c.id == budgets.c.slice_of)
            )
            # the journal is partitioned by its period's start: only these partitions
            .where(
                journal.c.period_start.in_(
                    [literal(at, UTCDateTime()) for at in sorted(set(starts.values()))]
                )
            )
            .where(_current_periods(starts))
            .where(journal.c.created_at >= literal(since, UTCDateTime()))
            .group_by(name)
        )
        with self._driver.transaction() as cur:
            rows = cur.execute(query).all()
        return {r.budget: int(r.spent) for r in rows if r.spent}

    def settled_stats(self) -> dict[str, SettledStats]:
        """Each budget's attempts settled in its current period (those admitted on it,
        not below it): how many, their estimates and charges, how many were charged
        above their estimate and by how much in all."""
        now = self.now()
        starts = {kind: period_start(kind, now) for kind in PERIODS}
        owner, name = _owner_name()
        a = attempts.c
        over = a.actual > a.amount
        query = (
            select(
                name.label("budget"),
                func.count().label("settled"),
                func.sum(a.amount).label("estimated"),
                func.sum(a.actual).label("charged"),
                func.sum(case((over, 1), else_=0)).label("overruns"),
                func.sum(case((over, a.actual - a.amount), else_=0)).label("overrun"),
            )
            .select_from(
                budget_periods.join(attempts, a.period_id == budget_periods.c.id)
                .join(budgets, budgets.c.id == budget_periods.c.budget_id)
                .outerjoin(owner, owner.c.id == budgets.c.slice_of)
            )
            .where(_current_periods(starts))
            .where(a.state == "settled")
            .group_by(name)
        )
        with self._driver.transaction() as cur:
            rows = cur.execute(query).all()
        return {
            r.budget: SettledStats(
                int(r.settled), int(r.estimated), int(r.charged), int(r.overruns), int(r.overrun)
            )
            for r in rows
        }

    def open_attempts(self, *, limit: int = 500) -> list[Attempt]:
        """Attempts still holding money (reserved, sending, unknown), oldest first, at
        most ``limit``: read by the index on (state, created_at)."""
        check.positive(limit, "limit")
        query = (
            self._attempt_query()
            .where(attempts.c.state.in_(HOLDING_STATES))
            .order_by(attempts.c.created_at, attempts.c.id)
            .limit(limit)
        )
        with self._driver.transaction() as cur:
            return [_attempt(r) for r in cur.execute(query)]
