"""Escrow (O'Neil's escrow method; leased quotas as in GALE): an escrowed budget
draws a grant from its ancestors' periods in one write to each, and admits against it
on its own period row until it runs short; then it draws again. Its ancestors count
the grant in ``granted``, against their caps, so no cap is ever exceeded by a grant.

A grant is a share of what the ancestors have left (1/``GRANT_SHARE`` of the least of
them), at least what the admission needs and at most what the budget's own cap leaves:
large while there is room, shrinking to exactly the admission as an ancestor nears its
cap. A budget short of money, for a grant or for a direct admission, first takes back
what the escrowed budgets under it (at any depth) hold unused (passing over one in the middle
of an admission), so a request that fits what is left is admitted. What a grant
leaves unused goes back at period end, on a freeze, and once the budget has not drawn
for a while (beat).

Locks are taken the escrowed period first, then its ancestors' periods by budget id:
the order of an admission, a settlement and a return alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import BudgetExceeded, BudgetFrozen
from . import statements as sql
from .counters import owe_grant, record_grant
from .driver import Cursor
from .periods import PeriodClosed, period_start

#: A grant is this fraction (1/N) of what the ancestors have left.
GRANT_SHARE = 8


@dataclass(frozen=True, slots=True)
class Escrow:
    """Where a chain's holds stop: the escrowed budget, and what it draws from."""

    budget_id: int
    name: str
    parent_id: int
    #: (budget id, name, kind of period) of each ancestor, by budget id
    ancestors: tuple[tuple[int, str, str], ...]

    @property
    def chain_ids(self) -> tuple[int, ...]:
        return (self.budget_id, *(budget_id for budget_id, _, _ in self.ancestors))


def _ids(escrow: Escrow, periods: dict[int, tuple[int, datetime]]) -> dict[str, int]:
    ids = {f"b{i}": budget_id for i, budget_id in enumerate(escrow.chain_ids)}
    for i, (budget_id, _, _) in enumerate(escrow.ancestors, start=1):
        ids[f"p{i}"] = periods[budget_id][0]
    return ids


def admit(
    cur: Cursor,
    escrow: Escrow,
    periods: dict[int, tuple[int, datetime]],
    amount: int,
    stamp: Any,
) -> None:
    """Hold ``amount`` in the escrowed budget's period, within its own cap and its
    grant, drawing more first where the grant is short. A refusal raises."""
    period_id = periods[escrow.budget_id][0]
    depth = len(escrow.chain_ids)
    ids = {"true": True, **_ids(escrow, periods)}
    params = {"amount": amount, "period_id": period_id, **ids}
    if cur.one(sql.escrow_admit(depth), params) is not None:
        return
    row = cur.one(sql.LOCK_FOR_DRAW, {"period_id": period_id})
    assert row is not None  # found before the transaction began
    available, room, closed = int(row[0]), int(row[1]), row[2]
    if closed is not None:
        raise PeriodClosed(period_id)
    frozen = cur.one(sql.frozen_in_chain(depth), ids)
    if frozen is not None:
        raise BudgetFrozen(frozen[0])
    if available < amount and reclaim_under(cur, escrow.budget_id, stamp):
        # its own cap was short by what escrowed budgets under it (its slices, its
        # tenants) hold unused: taken back, as any short budget takes it back
        row = cur.one(sql.LOCK_FOR_DRAW, {"period_id": period_id})
        assert row is not None
        available, room = int(row[0]), int(row[1])
    if available < amount:
        raise BudgetExceeded(escrow.name, amount, available)
    if room < amount:
        _draw(cur, escrow, periods, amount, room, available - room, stamp)
    else:
        _check_overspent(cur, escrow, periods, amount, room, stamp)
    if cur.one(sql.escrow_admit(depth), params) is not None:
        return
    # Every period it reads is locked now: only a freeze committed since the flags
    # were read refuses it here.
    frozen = cur.one(sql.frozen_in_chain(depth), ids)
    if frozen is not None:
        raise BudgetFrozen(frozen[0])
    raise AssertionError(f"escrowed period {period_id} refused {amount} it was checked for")


def _check_overspent(
    cur: Cursor,
    escrow: Escrow,
    periods: dict[int, tuple[int, datetime]],
    amount: int,
    room: int,
    stamp: Any,
) -> None:
    """The grant covers ``amount``, but an ancestor is past its cap by more than the
    grant leaves (an overrun under it): admitted only if what its other escrowed
    children hold unused, taken back, makes up for it, as without escrow."""
    for budget_id, name, _ in escrow.ancestors:
        source = periods[budget_id][0]
        # locked (after the escrowed period, by budget id: the order of a draw), so that
        # the admission's own read of it sees what was checked here
        if _left(cur, source, lock=True) + room - amount >= 0:
            continue
        reclaim_under(cur, budget_id, stamp, but=escrow.budget_id)
        left = _left(cur, source)
        if left + room - amount < 0:
            raise BudgetExceeded(name, amount, left + room)


def _left(cur: Cursor, period_id: int, *, lock: bool = False) -> int:
    statement = sql.LOCK_PERIOD_AVAILABLE if lock else sql.PERIOD_AVAILABLE
    row = cur.one(statement, {"period_id": period_id})
    return 0 if row is None else int(row[0])


def aligned(escrow: Escrow, periods: dict[int, tuple[int, datetime]]) -> bool:
    """Whether each ancestor's admitting period is the one that contains the escrowed
    budget's: only then may it draw (else this host admits in a period they left)."""
    start = periods[escrow.budget_id][1]
    return all(
        periods[budget_id][1] == period_start(kind, start)  # type: ignore[arg-type]
        for budget_id, _, kind in escrow.ancestors
    )


def _draw(
    cur: Cursor,
    escrow: Escrow,
    periods: dict[int, tuple[int, datetime]],
    amount: int,
    room: int,
    headroom: int,
    stamp: Any,
) -> None:
    # A room below 0 (never left so: a charge above the grant draws at once) is owed too.
    need = amount - room
    if not aligned(escrow, periods):
        # This host admits in a period its ancestors have left behind: admit again.
        raise PeriodClosed(periods[escrow.budget_id][0])
    sources = [(periods[budget_id][0], budget_id, name) for budget_id, name, _ in escrow.ancestors]
    least = min(max(_left(cur, source), 0) for source, _, _ in sources)
    grant = max(need, min(headroom, least // GRANT_SHARE))
    done: list[int] = []
    for source, budget_id, name in sources:
        reclaimed = False
        while cur.one(sql.GRANT, {"amount": grant, "period_id": source, "false": False}) is None:
            if grant > need:
                for earlier in done:
                    cur.one(sql.GRANT_OWED, {"amount": need - grant, "period_id": earlier})
                grant = need
                continue
            if not reclaimed:
                reclaimed = True
                if reclaim_under(cur, budget_id, stamp, but=escrow.budget_id):
                    continue
            refusal = cur.one(sql.REFUSAL, {"period_id": source})
            left, frozen, closed = refusal or (0, True, None)
            if closed is not None:
                raise PeriodClosed(source)
            if frozen:
                raise BudgetFrozen(name)
            raise BudgetExceeded(name, amount, int(left) + max(room, 0))
        done.append(source)
    record_grant(cur, periods[escrow.budget_id][0], done, grant, stamp, None)


def reclaim_under(cur: Cursor, budget_id: int, stamp: Any, *, but: int = 0) -> bool:
    """Take back what the escrowed budgets under ``budget_id``, at any depth (but
    ``but``, the one drawing), hold unused, passing over one in the middle of an
    admission: a budget short of money does this before it refuses. True if any came
    back."""
    under = cur.all(sql.UNUSED_GRANTS_UNDER, {"true": True, "parent_id": budget_id, "but": but})
    back = 0
    for (period_id,) in under:
        back += give_back(cur, int(period_id), stamp, "taken back to admit", busy_ok=True)
    return back > 0


def give_back(cur: Cursor, period_id: int, stamp: Any, note: str, *, busy_ok: bool = False) -> int:
    """Return what the escrowed period holds of its grants and does not use, to each
    ancestor's period it drew from; the amount returned. With ``busy_ok``, a period in
    the middle of an admission is passed over (0)."""
    statement = sql.LOCK_FOR_RETURN_UNLESS_BUSY if busy_ok else sql.LOCK_FOR_RETURN
    row = cur.one(statement, {"period_id": period_id})
    if row is None:
        return 0
    unused = int(row[2])
    if unused <= 0:
        return 0
    owe_grant(cur, period_id, -unused, stamp, note)
    return unused
