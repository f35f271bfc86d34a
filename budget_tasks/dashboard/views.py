"""What each page shows, as plain data (the JSON endpoints return it as it is; the
templates draw it). Money stays integer minor units; only shares for drawing are
fractions."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from ..ledger import Attempt, BudgetInfo, Ledger
from ..ledger.periods import Period, next_period_start
from ..ledger.records import JournalEntry
from .reconcile import by_hand

#: The window a burn rate is measured over (clipped to the current period).
BURN_WINDOW = timedelta(hours=24)
#: Too short a window says nothing about a rate.
MIN_BURN_WINDOW = timedelta(minutes=1)
#: The most open holds one page lists.
HOLDS_LIMIT = 500
#: Age classes of holds, in seconds (the last one has no upper end).
AGE_CLASSES = ((0, "under 1m"), (60, "1-15m"), (900, "15m-1h"), (3600, "1h-1d"), (86400, "over 1d"))


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def _tree(infos: Sequence[BudgetInfo]) -> list[tuple[BudgetInfo, int]]:
    """The budgets with their depth, each parent followed by its tenants."""
    children: dict[str | None, list[BudgetInfo]] = {}
    names = {b.name for b in infos}
    for b in infos:
        parent = b.parent if b.parent in names else None
        children.setdefault(parent, []).append(b)
    out: list[tuple[BudgetInfo, int]] = []

    def walk(parent: str | None, depth: int) -> None:
        for b in sorted(children.get(parent, []), key=lambda x: x.name):
            out.append((b, depth))
            walk(b.name, depth + 1)

    walk(None, 0)
    return out


def burn(
    *, spent_in_window: int, window: timedelta, available: int, now: datetime, end: datetime | None
) -> dict[str, Any]:
    """The spending rate over ``window`` (minor units per hour) and when, at that rate,
    what is ``available`` is gone: ``reaches_cap_at`` (None: never at this rate) and
    whether that is before the period ``end`` (None: a budget without periods)."""
    seconds = int(window.total_seconds())
    if window < MIN_BURN_WINDOW or spent_in_window <= 0:
        return {"per_hour": 0, "reaches_cap_at": None, "before_period_end": None}
    per_hour = spent_in_window * 3600 // seconds
    # integer arithmetic: the seconds until the rate spends what is left
    left = max(available, 0) * seconds // spent_in_window
    reach = now + timedelta(seconds=left)
    return {
        "per_hour": per_hour,
        "reaches_cap_at": reach.isoformat(),
        # a budget without periods has no end to reach the cap before
        "before_period_end": None if end is None else reach < end,
    }


def budgets_view(ledger: Ledger) -> list[dict[str, Any]]:
    """Each budget's current period (tenants under their parent): cap, spent, held,
    available, its burn rate and when that reaches the cap, its overruns and the
    charged-to-estimated ratio of its settled attempts (its tenants' included)."""
    views = ledger.views
    now = views.now()
    infos = views.budgets()
    reports = {r.budget: r for r in views.report()}
    recent = views.spend_since(now - BURN_WINDOW)
    stats = views.settled_stats()
    tree = _tree(infos)
    # a parent's settled attempts are its own and its tenants'
    below: dict[str, list[str]] = {b.name: [b.name] for b, _ in tree}
    by_name = {b.name: b for b in infos}
    for b, _ in tree:
        ancestor = b.parent
        seen = {b.name}
        while ancestor is not None and ancestor in by_name and ancestor not in seen:
            below[ancestor].append(b.name)
            seen.add(ancestor)
            ancestor = by_name[ancestor].parent
    out = []
    for info, depth in tree:
        r = reports.get(info.name)
        if r is None:  # a slice: folded into its owner by the report
            continue
        start = r.period_start
        kind: Period = info.period  # type: ignore[assignment]
        end = next_period_start(kind, start)
        window = min(BURN_WINDOW, now - start) if info.period != "none" else BURN_WINDOW
        mine = [stats[n] for n in below[info.name] if n in stats]
        estimated = sum(s.estimated for s in mine)
        charged = sum(s.charged for s in mine)
        out.append(
            {
                "budget": info.name,
                "parent": info.parent,
                "tenant": info.tenant,
                "depth": depth,
                "period": info.period,
                "period_start": _iso(start),
                "period_end": _iso(end),
                "cap": r.cap,
                "spent": r.spent,
                "held": r.held,
                "granted": r.granted,
                "available": r.available,
                "usable": r.usable,
                "frozen": r.frozen,
                "oldest_hold_s": None
                if r.oldest_hold is None
                else int(r.oldest_hold.total_seconds()),
                "overrun": r.overrun,
                "settled": sum(s.settled for s in mine),
                "estimated": estimated,
                "charged": charged,
                "overruns": sum(s.overruns for s in mine),
                # a ratio for reading, not money
                "actual_to_estimate": round(charged / estimated, 3) if estimated else None,
                "spent_last_window": recent.get(info.name, 0),
                "window_s": int(window.total_seconds()),
                "burn": burn(
                    spent_in_window=recent.get(info.name, 0),
                    window=window,
                    available=r.available,
                    now=now,
                    end=end,
                ),
            }
        )
    return out


def spend_view(ledger: Ledger, budget: str, bucket: str, hours: int) -> dict[str, Any]:
    """``budget``'s charges in hour or day buckets over the last ``hours``, with their
    running total from the window's start and the current cap."""
    views = ledger.views
    now = views.now()
    since = now - timedelta(hours=hours)
    series = views.spend_series(budget, since=since, bucket=bucket)
    cap = next((r.cap for r in views.report() if r.budget == budget), None)
    total = 0
    points = []
    for at, spent in series:
        total += spent
        points.append({"at": at.isoformat(), "spent": spent, "total": total})
    return {
        "budget": budget,
        "bucket": bucket,
        "since": since.isoformat(),
        "until": now.isoformat(),
        "cap": cap,
        "points": points,
    }


def attempt_row(a: Attempt, now: datetime) -> dict[str, Any]:
    return {
        "attempt": a.key,
        "budget": a.budget,
        "state": a.state,
        "amount": a.amount,
        "actual": a.actual,
        "age_s": int((now - a.created_at).total_seconds()),
        "provider": a.provider,
        "model": a.model,
        "request_id": a.request_id,
        "operation": a.operation_key,
        "reason": a.reason,
        "flagged": a.flagged_at is not None,
        "created_at": a.created_at.isoformat(),
    }


def _age_class(seconds: int) -> str:
    label = AGE_CLASSES[0][1]
    for floor, name in AGE_CLASSES:
        if seconds >= floor:
            label = name
    return label


def holds_view(ledger: Ledger, limit: int = HOLDS_LIMIT) -> dict[str, Any]:
    """Open holds (oldest first, at most ``limit``) and their counts by state and age."""
    now = ledger.views.now()
    rows = [attempt_row(a, now) for a in ledger.views.open_attempts(limit=limit)]
    summary: dict[str, dict[str, int]] = {}
    for row in rows:
        by_age = summary.setdefault(row["state"], {name: 0 for _, name in AGE_CLASSES})
        by_age[_age_class(row["age_s"])] += 1
    return {"holds": rows, "by_state_and_age": summary, "limit": limit}


def worklist_view(ledger: Ledger, limit: int = HOLDS_LIMIT) -> list[dict[str, Any]]:
    """The unknown outcomes reconciliation cannot settle, oldest first, each with why."""
    now = ledger.views.now()
    out = []
    for a in ledger.views.open_attempts(limit=limit):
        why = by_hand(a)
        if why is not None:
            out.append({**attempt_row(a, now), "why": why, "note": a.note})
    return out


def _journal_row(e: JournalEntry) -> dict[str, Any]:
    return {
        "at": e.created_at.isoformat(),
        "attempt": e.attempt,
        "budget": e.budget,
        "kind": e.kind,
        "held_delta": e.held_delta,
        "spent_delta": e.spent_delta,
        "note": e.note,
        "actor": e.actor,
    }


def attempt_view(ledger: Ledger, key: str) -> dict[str, Any]:
    """One attempt, its journal entries, the operation it belongs to (with its other
    attempts), and why reconciliation cannot settle it, where it cannot."""
    views = ledger.views
    now = views.now()
    a = views.attempt(key)
    operation = None
    if a.operation_key is not None:
        history = views.operation_history(a.operation_key)
        op = history.operation
        operation = {
            "operation": op.key,
            "status": op.status,
            "task": op.task,
            "error": op.error,
            "attempts": [attempt_row(x, now) for x in history.attempts],
        }
    return {
        "attempt": {
            **attempt_row(a, now),
            "note": a.note,
            "lookup": a.lookup,
            "recorded_actual": a.recorded_actual,
            "estimate_only": a.estimate_only,
            "period_start": a.period_start.isoformat(),
            "resolved_at": _iso(a.resolved_at),
        },
        "holding": a.state in ("reserved", "sending", "unknown"),
        "by_hand": by_hand(a),
        "journal": [_journal_row(e) for e in views.attempt_journal(key)],
        "operation": operation,
    }


def operations_view(ledger: Ledger, status: str | None, limit: int) -> list[dict[str, Any]]:
    """Operations (the most recently changed first), each with its attempts."""
    views = ledger.views
    now = views.now()
    ops = views.operations(status=status, limit=limit)
    found = views.operation_attempts([o.key for o in ops])
    return [
        {
            "operation": o.key,
            "status": o.status,
            "task": o.task,
            "runs": o.runs,
            "deliveries": o.deliveries,
            "replays": o.replays,
            "error": o.error,
            "created_at": o.created_at.isoformat(),
            "completed_at": _iso(o.completed_at),
            "attempts": [attempt_row(a, now) for a in found.get(o.key, [])],
        }
        for o in ops
    ]


def rates_view(ledger: Ledger) -> list[dict[str, Any]]:
    """Every rate window (by provider, scope and kind): its limit a minute, what it
    holds now (below 0: owed to the calls booked ahead) and how many are booked."""
    return [
        {
            "provider": w.provider,
            "scope": w.scope,
            "kind": w.kind,
            "per_minute": w.per_minute,
            "available": w.available,
            "booked": w.booked,
        }
        for w in ledger.rates.windows()
    ]
