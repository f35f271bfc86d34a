"""How a period's counters change: the one journal writer, and applying a change with
what must follow it (a closed period that carried too much gives it back; an escrowed
period charged above its grant draws the rest from its ancestors)."""

from __future__ import annotations

import logging
from typing import Any

from . import statements as sql
from .driver import Cursor
from .periods import period_start

log = logging.getLogger("budget_tasks.ledger")


def _journal(
    cur: Cursor,
    attempt_id: int | None,
    period_id: int,
    kind: str,
    held_delta: int,
    spent_delta: int,
    note: str | None,
    stamp: Any,
    ref: str | None = None,
    actor: str | None = None,
    *,
    drawn_delta: int = 0,
    granted_delta: int = 0,
    cap_delta: int = 0,
) -> None:
    """Append one journal entry: the only way the counters' history is written
    (``attempt_id`` None for an operator's action on a budget or an operation, and for
    a grant; ``actor``: who acted, for an operator's action)."""
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
            "actor": actor,
            "drawn_delta": drawn_delta,
            "granted_delta": granted_delta,
            "cap_delta": cap_delta,
        },
    )


def _apply(cur: Cursor, statement: str, params: dict[str, Any], stamp: Any) -> None:
    """Apply a change to a period's counters (a statement returning ``_AFTER_CHANGE``).

    An escrowed period left with less grant than it has spent and held (a charge above
    its hold, a provider correction) draws the difference from its ancestors at once,
    whatever they have left: the ancestors' caps count what was spent below them, as
    they would without escrow. A closed escrowed period left with grant it no longer
    uses (a late settlement below its hold, a release) gives it back at once: a closed
    period admits nothing, and its ancestors' figures read what it spent from what it
    was granted (see :mod:`.reports`)."""
    row = cur.one(statement, params)
    if row is None:
        return
    escrowed, room, closed = row[0], row[1], row[4]
    _give_back_carry(cur, params["period_id"], row[2], row[3])
    if escrowed and room < 0:
        owe_grant(cur, params["period_id"], -room, stamp, "charged above the grant")
    elif escrowed and room > 0 and closed is not None:
        owe_grant(cur, params["period_id"], -room, stamp, "the period ended")


def owe_grant(cur: Cursor, period_id: int, amount: int, stamp: Any, note: str) -> None:
    """Move ``amount`` of grant to the escrowed period ``period_id`` from each of its
    ancestors' periods it draws from, unconditionally (a negative amount gives back)."""
    sources = grant_sources(cur, period_id)
    for ancestor_period in sources:
        row = cur.one(sql.GRANT_OWED, {"amount": amount, "period_id": ancestor_period})
        assert row is not None  # grant_sources found it
        _give_back_carry(cur, ancestor_period, row[0], row[1])
    record_grant(cur, period_id, sources, amount, stamp, note)


def record_grant(
    cur: Cursor, period_id: int, sources: list[int], amount: int, stamp: Any, note: str | None
) -> None:
    """The escrowed period's side of a grant its ``sources`` have counted already (a
    negative amount: one given back), and the journal rows of both sides."""
    kind = "grant" if amount > 0 else "return"
    if amount > 0:
        cur.run(sql.DRAW, {"amount": amount, "period_id": period_id, "now": stamp})
    else:
        cur.run(sql.UNDRAW, {"amount": -amount, "period_id": period_id})
    _journal(cur, None, period_id, kind, 0, 0, note, stamp, drawn_delta=amount)
    for source in sources:
        _journal(cur, None, source, kind, 0, 0, note, stamp, granted_delta=amount)


def grant_sources(cur: Cursor, period_id: int) -> list[int]:
    """The periods an escrowed period draws from: each ancestor's period that contains
    its start (escrow needs each ancestor's periods to contain its own), by budget id."""
    row = cur.one(sql.PERIOD_OWNER, {"period_id": period_id})
    assert row is not None
    budget_id, start = row
    start = cur.driver.from_ts(start)
    found: list[tuple[int, int]] = []
    link = cur.one(sql.BUDGET_LINK, {"budget_id": budget_id})
    while link is not None and link[3] is not None:
        link = cur.one(sql.BUDGET_LINK, {"budget_id": link[3]})
        assert link is not None
        ancestor, _, kind, _, _, _ = link
        at = period_start(kind, start)
        source = cur.one(sql.PERIOD_ID, {"budget_id": ancestor, "start": cur.driver.ts(at)})
        if source is not None:
            found.append((int(ancestor), int(source[0])))
    return [period for _, period in sorted(found)]


def _give_back_carry(cur: Cursor, period_id: int, carried: int, available: int) -> None:
    """If the period is closed and carried what it left unused, and the change leaves
    it less unused than it carried (an overrun settled late, a provider correction),
    the difference comes off the period it carried into: no money is spent in one
    period and carried into the next too."""
    # A period that carried on what it received passes the take-back on in turn, until
    # a period that still had room for it (or the open one) absorbs it.
    while True:
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
        if row is None:
            return
        period_id, carried, available = row[0], row[1], row[2]
