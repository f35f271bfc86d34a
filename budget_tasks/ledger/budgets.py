"""Budgets: create them, read their configuration, change their cap, freeze them,
open their periods."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    ColumnElement,
    select,
)

from .. import _validate as check
from ..errors import (
    BudgetExists,
    CapBelowCommitted,
    UnknownBudget,
)
from . import escrow
from . import statements as sql
from .base import SLICE_MARK, is_slice_name, log, slice_name
from .counters import _journal
from .driver import Cursor
from .periods import (
    PERIODS,
    RENEWALS,
    Period,
    Renewal,
    period_start,
)
from .records import (
    Balance,
    BudgetInfo,
)
from .reports import Reports
from .schema import (
    budgets,
)


class Budgets(Reports):
    """The budget methods of :class:`~budget_tasks.Ledger`."""

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
        escrow: bool = False,
        slices: int = 1,
    ) -> BudgetInfo:
        """Create a budget with ``cap`` minor units per period.

        ``renewal`` is the written policy for what is left when a period ends:
        ``reset`` or ``rollover`` (carry the unused amount, the cap never above
        ``rollover_ceiling``, default 3x ``cap``). With ``escrow`` (a budget with a
        parent), it admits against grants drawn from its ancestors instead of writing
        their period rows on every admission and settlement: for many tenants under one
        parent. Each ancestor's periods must contain the budget's own (an ancestor's
        period is ``none``, the same, or the budget's is ``day``); it is chosen here
        and never changes. With ``slices`` above 1, the budget's money is split over
        that many rows that share its cap (see ``set_slices``): for one budget that many
        workers admit on at once.
        """
        check.printable(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        if is_slice_name(name):
            raise ValueError(f"budget name {name!r}: names ending {SLICE_MARK}<n> are slices'")
        _check_slices(slices)
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
        with self._driver.transaction() as cur:
            parent_id = None
            if escrow and parent is None:
                raise ValueError(f"budget {name!r}: escrow needs a parent to draw from")
            if parent is not None:
                check.text(parent, "parent", max_length=check.MAX_NAME_LENGTH)
                found = cur.one(sql.BUDGET_ID, {"name": parent})
                if found is None:
                    raise UnknownBudget(parent)
                parent_id = found[0]
            if escrow and parent_id is not None:
                _check_escrow(cur, name, period, int(parent_id))
            created = cur.one(
                sql.INSERT_BUDGET,
                self._budget_row(
                    name,
                    cap=cap,
                    period=period,
                    renewal=renewal,
                    tenant=tenant,
                    parent_id=parent_id,
                    escrow=escrow,
                    rollover_ceiling=rollover_ceiling,
                ),
            )
            if created is None:
                raise BudgetExists(name)
            # in the budget's own transaction: a refused slicing leaves no budget behind
            self._add_slices(cur, int(created[0]), name, period, tenant, 0, slices)
        return self.budget(name)

    def set_slices(self, name: str, slices: int) -> BudgetInfo:
        """Split the budget's money over ``slices`` rows that share its cap (1: one row,
        as a budget is made). Each slice is an escrowed budget under it, named
        ``<name>#slice<k>``: an admission takes one at random and draws from the
        budget's own row only when that slice is short, taking back what the other
        slices hold unused before it refuses. Balances, reports and attempts show the
        budget, never its slices. Fewer slices leave the others unused (beat gives back
        what they hold); a running host reads the count again within a minute."""
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        _check_slices(slices)
        info = self.budget(name)
        if is_slice_name(name):
            raise ValueError(f"budget {name!r} is a slice: it is not sliced again")
        with self._driver.transaction() as cur:
            made = int((cur.one(sql.SLICE_COUNT, {"owner_id": info.id}) or (0,))[0])
            self._add_slices(cur, info.id, name, info.period, info.tenant, made, slices)
        with self._lock:
            self._slice_names.pop(name, None)
        return self.budget(name)

    def _add_slices(
        self,
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
            _check_escrow(cur, slice_name(name, made), period, owner_id)
        for index in range(made, slices):
            # a slice's own cap is never the limit: the budget's is
            row = self._budget_row(
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

    def _budget_row(
        self,
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
            "now": self._driver.ts(self.now()),
            "escrow": bool(escrow),
            "slices": 1,
            "slice_of": slice_of,
        }

    def budget(self, name: str) -> BudgetInfo:
        """A budget's configuration. Raises UnknownBudget."""
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        for info in self._budget_rows(budgets.c.name == name):
            return info
        raise UnknownBudget(name)

    def budgets(self) -> list[BudgetInfo]:
        """Every budget, by name (a sliced budget's slices are its own: not listed)."""
        return self._budget_rows(budgets.c.slice_of.is_(None))

    def _budget_rows(self, where: ColumnElement[bool]) -> list[BudgetInfo]:
        parent = budgets.alias("parent")
        query = (
            select(budgets, parent.c.name.label("parent_name"))
            .outerjoin(parent, parent.c.id == budgets.c.parent_id)
            .where(where)
            .order_by(budgets.c.name)
        )
        with self._driver.transaction() as cur:
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
            )
            for r in rows
        ]

    def set_cap(
        self, name: str, cap: int, *, note: str | None = None, actor: str | None = None
    ) -> BudgetInfo:
        """Change a budget's cap (its allowance per period). The current open period's
        cap moves by the same amount (what it carried stays); the change is a journal
        entry (kind ``cap``) naming ``actor`` (default: the OS user and host). Lowering
        it below what that period has spent and holds is refused (CapBelowCommitted):
        that money is committed; freeze the budget to stop admissions. A rollover
        budget's ceiling is never below its cap."""
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        check.money(cap, "cap")
        check.optional_text(note, "note", max_length=10_000)
        actor = check.actor(actor)
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
            if current is not None and current[1] + delta < current[2]:
                # What the escrowed budgets under it (a tenant, a slice) hold unused is
                # not committed: taken back, it leaves what they spent and hold.
                unused = cur.all(
                    sql.UNUSED_GRANTS_UNDER, {"true": True, "parent_id": budget_id, "but": 0}
                )
                for (below,) in unused:
                    escrow.give_back(cur, int(below), stamp, "taken back for a lower cap")
                current = cur.one(sql.LOCK_OPEN_PERIOD, {"budget_id": budget_id})
            if current is not None:
                period_id, period_cap, committed = current
                if period_cap + delta < committed:
                    raise CapBelowCommitted(name, cap, int(committed))
            cur.run(sql.SET_BUDGET_CAP, {"cap": cap, "budget_id": budget_id})
            if current is not None and delta:
                cur.run(sql.MOVE_PERIOD_CAP, {"delta": delta, "period_id": period_id})
                _journal(
                    cur,
                    None,
                    period_id,
                    "cap",
                    0,
                    0,
                    note or f"cap {old} -> {cap}",
                    stamp,
                    actor=actor,
                    cap_delta=delta,
                )
        log.info("budget %s: cap %d -> %d", name, old, cap)
        return self.budget(name)

    def freeze(self, name: str, *, note: str | None = None, actor: str | None = None) -> None:
        """Stop all admission on this budget and its descendants; settlement goes on.
        A journal row (kind ``freeze``) names ``actor`` (default: the OS user and host)
        and ``note``."""
        self._set_frozen(name, True, note, actor)

    def unfreeze(self, name: str, *, note: str | None = None, actor: str | None = None) -> None:
        """Admit again on this budget (a journal row of kind ``unfreeze``, as a freeze)."""
        self._set_frozen(name, False, note, actor)

    def _set_frozen(self, name: str, frozen: bool, note: str | None, actor: str | None) -> None:
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        check.optional_text(note, "note", max_length=10_000)
        actor = check.actor(actor)
        now = self.now()
        budget_id, _, period = self._chain(name)[0]
        period_id, _ = self._period_id(budget_id, period_start(period, now))  # type: ignore[arg-type]
        kind = "freeze" if frozen else "unfreeze"
        with self._driver.transaction() as cur:
            done = cur.run(sql.SET_FROZEN, {"frozen": frozen, "name": name})
            if done:
                stamp = self._driver.ts(now)
                _journal(cur, None, period_id, kind, 0, 0, note or kind, stamp, actor=actor)
        if not done:
            raise UnknownBudget(name)
        if frozen:
            self._return_grants_below(name)

    def _return_grants_below(self, name: str) -> None:
        # A frozen chain admits nothing (every escrowed admission reads the chain's
        # flags); what its escrowed budgets hold unused goes back, each passed over
        # while in the middle of an admission (beat's idle return takes it later).
        with self._driver.transaction() as cur:
            found = cur.all(sql.ESCROWED_BELOW, {"name": name, "true": True})
            stamp = self._driver.ts(self.now())
            for (period_id,) in found:
                escrow.give_back(cur, int(period_id), stamp, "frozen", busy_ok=True)

    def open_period(self, budget: str, at: datetime | None = None) -> Balance:
        """Open (if not yet open) the budget's period containing ``at`` (default: now),
        closing the periods before it: the one just before carries what it left unused
        into it, by the budget's renewal policy."""
        check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        at = self.now() if at is None else check.moment(at, "at")
        budget_id, _, period = self._chain(budget)[0]
        self._period_id(budget_id, period_start(period, at))  # type: ignore[arg-type]
        return self.balance(budget, at=at)


#: The most slices one budget may have.
MAX_SLICES = 64


def _check_slices(slices: int) -> None:
    if isinstance(slices, bool) or not isinstance(slices, int) or not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"slices must be an int from 1 to {MAX_SLICES}, not {slices!r}")


def _check_escrow(cur: Cursor, name: str, period: str, parent_id: int) -> None:
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
