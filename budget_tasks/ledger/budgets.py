"""Budget rows: read their configuration, add slices, freeze, give back what escrowed
budgets under one hold unused (the operator's :class:`.Ledger` creates and changes
budgets with these)."""

from __future__ import annotations

from sqlalchemy import (
    ColumnElement,
    select,
)

from .. import _validate as check
from ..errors import (
    UnknownBudget,
)
from . import escrow
from . import statements as sql
from .counters import _journal
from .driver import Cursor
from .periods import (
    period_start,
)
from .records import (
    BudgetInfo,
)
from .schema import (
    budgets,
)
from .store import Store, slice_name

#: The largest weight a budget may have in the rate windows its calls share.
MOST_RATE_WEIGHT = 1000


def add_slices(
    store: Store,
    cur: Cursor,
    owner_id: int,
    name: str,
    period: str,
    tenant: str | None,
    made: int,
    slices: int,
) -> None:
    """Make the slices ``made .. slices-1`` of a budget and record its count, in
    the caller's transaction; every check comes before the first write."""
    if slices == 1 and made == 0:
        return
    longest = slice_name(name, max(slices, made) - 1)
    if len(longest) > check.MAX_NAME_LENGTH:
        raise ValueError(
            f"budget name {name!r} is too long to slice {slices} ways: its slices' "
            f"names ({longest!r}) pass {check.MAX_NAME_LENGTH} characters"
        )
    if made < slices:
        check_escrow(cur, slice_name(name, made), period, owner_id)
    for index in range(made, slices):
        # a slice's own cap is never the limit: the budget's is
        row = budget_row(
            store,
            slice_name(name, index),
            cap=check.MAX_MONEY,
            period=period,
            tenant=tenant,
            parent_id=owner_id,
            escrow=True,
            slice_of=owner_id,
        )
        cur.one(sql.INSERT_BUDGET, row)
    cur.run(sql.SET_SLICES, {"slices": slices, "owner_id": owner_id})


def budget_row(
    store: Store,
    name: str,
    *,
    cap: int,
    period: str,
    renewal: str = "reset",
    tenant: str | None,
    parent_id: int | None,
    escrow: bool,
    rollover_ceiling: int | None = None,
    slice_of: int | None = None,
) -> dict[str, object]:
    """The parameters of INSERT_BUDGET: a budget made unfrozen, in one row."""
    return {
        "name": name,
        "tenant": tenant,
        "parent_id": parent_id,
        "cap": cap,
        "period": period,
        "renewal": renewal,
        "rollover_ceiling": rollover_ceiling,
        "false": False,
        "now": store.driver.ts(store.now()),
        "escrow": bool(escrow),
        "slices": 1,
        "slice_of": slice_of,
    }


def all_budgets(store: Store) -> list[BudgetInfo]:
    """Every budget, by name (a sliced budget's slices are its own: not listed)."""
    return budget_rows(store, budgets.c.slice_of.is_(None))


def budget_rows(store: Store, where: ColumnElement[bool]) -> list[BudgetInfo]:
    parent = budgets.alias("parent")
    query = (
        select(budgets, parent.c.name.label("parent_name"))
        .outerjoin(parent, parent.c.id == budgets.c.parent_id)
        .where(where)
        .order_by(budgets.c.name)
    )
    with store.driver.transaction() as cur:
        rows = cur.execute(query).all()
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
            escrow=bool(r.escrow),
            slices=int(r.slices),
            rate_weight=r.rate_weight,
        )
        for r in rows
    ]


def set_frozen(store: Store, name: str, frozen: bool, note: str | None, actor: str | None) -> None:
    check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
    check.optional_text(note, "note", max_length=10_000)
    actor = check.actor(actor)
    now = store.now()
    budget_id, _, period = store.chain(name)[0]
    period_id, _ = store.period_id(budget_id, period_start(period, now))  # type: ignore[arg-type]
    kind = "freeze" if frozen else "unfreeze"
    with store.driver.transaction() as cur:
        done = cur.run(sql.SET_FROZEN, {"frozen": frozen, "name": name})
        if done:
            stamp = store.driver.ts(now)
            _journal(cur, None, period_id, kind, 0, 0, note or kind, stamp, actor=actor)
    if not done:
        raise UnknownBudget(name)
    if frozen:
        return_grants_below(store, name)


def set_rate_weight(store: Store, name: str, weight: int | None) -> None:
    check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
    if weight is not None and (check.count(weight, "rate weight") < 1 or weight > MOST_RATE_WEIGHT):
        raise ValueError(f"a rate weight is from 1 to {MOST_RATE_WEIGHT}, not {weight}")
    with store.driver.transaction() as cur:
        if not cur.run(sql.SET_RATE_WEIGHT, {"weight": weight, "name": name}):
            raise UnknownBudget(name)


def return_grants_below(store: Store, name: str) -> None:
    # A frozen chain admits nothing (every escrowed admission reads the chain's
    # flags); what its escrowed budgets hold unused goes back, each passed over
    # while in the middle of an admission (beat's idle return takes it later).
    with store.driver.transaction() as cur:
        found = cur.all(sql.ESCROWED_BELOW, {"name": name, "true": True})
        stamp = store.driver.ts(store.now())
        for (period_id,) in found:
            escrow.give_back(cur, int(period_id), stamp, "frozen", busy_ok=True)


#: The most slices one budget may have.
MAX_SLICES = 64


def check_slices(slices: int) -> None:
    if isinstance(slices, bool) or not isinstance(slices, int) or not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"slices must be an int from 1 to {MAX_SLICES}, not {slices!r}")


def check_escrow(cur: Cursor, name: str, period: str, parent_id: int) -> None:
    """An escrowed budget's period must lie within one period of each ancestor, so
    that each of its periods draws from one period of each."""
    link = cur.one(sql.BUDGET_LINK, {"budget_id": parent_id})
    while link is not None:
        _, ancestor, kind, next_id, _, _ = link
        if not (kind == "none" or kind == period or period == "day"):
            raise ValueError(
                f"budget {name!r} (period {period!r}) cannot draw grants from {ancestor!r} "
                f"(period {kind!r}): each ancestor's period must contain the budget's"
            )
        link = None if next_id is None else cur.one(sql.BUDGET_LINK, {"budget_id": next_id})
