"""Reports: balances, attempts and holds, every budget's current period in one query,
a parent's figures rolled up from the escrowed budgets under it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
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
)
from .schema import (
    UTCDateTime,
    attempts,
    budget_periods,
    budgets,
    operations,
)
from .states import HOLDING_STATES
from .store import Store, attempt_of


def _holds_query() -> Any:
    """What :func:`holds_where` reads: the holding attempts by their state's index,
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


def balance(store: Store, budget: str, *, at: datetime | None = None) -> Balance:
    """The budget's counters for the period containing ``at`` (default: now).

    A read opens nothing: for a period not open yet, it shows what the period would
    open with now (its renewal applied to the period before, as that stands)."""
    check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
    at = store.now() if at is None else check.moment(at, "at")
    budget_id, name, period = store.chain(budget)[0]
    start = period_start(period, at)  # type: ignore[arg-type]
    at_start = {"budget_id": budget_id, "start": store.driver.ts(start)}
    with store.driver.transaction() as cur:
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
                    {"budget_id": budget_id, "start": store.driver.ts(prev_start)},
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


def attempt(store: Store, key: str) -> Attempt:
    """One attempt, with its state, amounts and provider ids."""
    check.text(key, "key")
    with store.driver.transaction() as cur:
        row = cur.execute(attempt_query().where(attempts.c.key == key)).first()
    if row is None:
        raise UnknownAttempt(key)
    return attempt_of(row)


def attempts_where(
    store: Store,
    *,
    budget: str | None = None,
    states: Iterable[str] | None = None,
    keys: Iterable[str] | None = None,
) -> list[Attempt]:
    """Attempts, oldest first, optionally of one budget, in some states, by key."""
    query = attempt_query().order_by(attempts.c.id)
    if keys is not None:
        query = query.where(attempts.c.key.in_(list(keys)))
    if budget is not None:
        owner = query.selected_columns.budget
        query = query.where(owner == budget)
    if states is not None:
        query = query.where(attempts.c.state.in_(list(states)))
    with store.driver.transaction() as cur:
        return [attempt_of(r) for r in cur.execute(query)]


def holds_where(
    store: Store,
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
    now = store.now()
    query = _holds_query().where(attempts.c.state.in_(states))
    if keys is not None:
        query = query.where(attempts.c.key.in_(list(keys)))
    if older_than is not None:
        check.duration(older_than, "older_than", allow_zero=True)
        query = query.where(attempts.c.created_at <= now - older_than)
    if budget is not None:
        owner = query.selected_columns.budget
        query = query.where(owner == budget)
    with store.driver.transaction() as cur:
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


def attempt_query() -> Any:
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


def report(store: Store) -> list[BudgetReport]:
    """Every budget's current period (cap, spent, held, available) and the age of
    its oldest open hold, in one set-based query: what a metrics scrape and
    ``budget-tasks status`` show. A period not open yet shows what it would open
    with; nothing is opened."""
    now = store.now()
    starts = {kind: period_start(kind, now) for kind in PERIODS}
    before = {kind: previous_period_start(kind, start) for kind, start in starts.items()}
    with store.driver.transaction() as tx:
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
            spent, held, granted = _rolled(spent, held, r.cur_granted, below.get(r.id, _Below()))
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
    return _with_usable(out, [r.id for r in rows if r.slice_of is None], parents)


def _with_usable(
    reports: list[BudgetReport], ids: list[int], parents: Mapping[int, int]
) -> list[BudgetReport]:
    """Each report with what it can still admit: its available, and no more than its
    parent can (whose available counts the unused grants below it: an admission takes
    them back); 0 under a freeze anywhere above."""
    by_id = dict(zip(ids, reports, strict=True))
    usable: dict[int, int] = {}

    def of(budget_id: int) -> int:
        if budget_id not in usable:
            usable[budget_id] = 0  # a cycle (never made) reads as nothing to admit
            own, parent = by_id[budget_id], parents.get(budget_id)
            found = 0 if own.frozen else own.available
            if parent in by_id:
                found = min(found, of(parent))
            usable[budget_id] = max(found, 0)
        return usable[budget_id]

    return [dataclasses.replace(r, usable=of(i)) for i, r in zip(ids, reports, strict=True)]
