"""What a dashboard reads (``ledger.views``): the reports, spend over time from the
journal, spend of the current periods since a moment, settled attempts against their
estimates, open attempts, an attempt's journal and operations' attempts, and what
each vendor was sent (for the drift check). Nothing here writes: writes go through
the operator's ledger."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import (
    and_,
    case,
    func,
    literal,
    select,
)

from .. import _validate as check
from . import oversight, reports, usage
from .buckets import as_utc, bucket_start
from .budgets import all_budgets
from .oversight import OperationHistory
from .periods import (
    PERIODS,
    Period,
    period_start,
)
from .records import (
    Attempt,
    BudgetInfo,
    BudgetReport,
    JournalEntry,
    Operation,
    SettledStats,
)
from .schema import (
    UTCDateTime,
    attempts,
    budget_periods,
    budgets,
    journal,
    operations,
)
from .states import HOLDING_STATES
from .store import Store, attempt_of
from .usage import UsageRow

#: The buckets a spend series is summed in.
BUCKETS = ("hour", "day")
#: The most buckets one series returns (31 days of hours).
MAX_BUCKETS = 31 * 24


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


class Views:
    """What a dashboard reads (``ledger.views``; see the module)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"Views({self._store.url!r})"

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._store.url

    def now(self) -> datetime:
        """The ledger's time (see :meth:`~budget_tasks.Ledger.now`)."""
        return self._store.now()

    def budgets(self) -> list[BudgetInfo]:
        """Every budget, by name."""
        return all_budgets(self._store)

    def report(self) -> list[BudgetReport]:
        """Every budget's current period (see :func:`.reports.report`)."""
        return reports.report(self._store)

    def attempt(self, key: str) -> Attempt:
        """One attempt, with its state, amounts and provider ids."""
        return reports.attempt(self._store, key)

    def operations(self, *, status: str | None = None, limit: int = 100) -> list[Operation]:
        """Operations, the most recently changed first, optionally in one status."""
        return oversight.recent_operations(self._store, status=status, limit=limit)

    def operation_history(self, key: str) -> OperationHistory:
        """One operation with its attempts, their journal and its events."""
        return oversight.operation_history(self._store, key)

    def attempt_journal(self, key: str) -> list[JournalEntry]:
        """Attempt ``key``'s journal entries (one per budget in its chain for each
        hold, charge, release or correction), oldest first."""
        check.text(key, "key")
        with self._store.driver.transaction() as cur:
            rows = cur.execute(oversight.journal_of(attempts.c.key == key)).all()
        return [oversight.entry_of(e) for e in rows]

    def operation_attempts(self, keys: list[str]) -> dict[str, list[Attempt]]:
        """The attempts of operations ``keys`` (read by the attempts' operation index),
        oldest first, by operation key; an operation without attempts is left out."""
        for key in keys:
            check.text(key, "idempotency key")
        if not keys:
            return {}
        ids = select(operations.c.id).where(operations.c.key.in_(list(keys)))
        query = (
            reports.attempt_query().where(attempts.c.operation_id.in_(ids)).order_by(attempts.c.id)
        )
        out: dict[str, list[Attempt]] = {}
        with self._store.driver.transaction() as cur:
            for row in cur.execute(query):
                found = attempt_of(row)
                out.setdefault(str(found.operation_key), []).append(found)
        return out

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
        self._store.chain(budget)  # an unknown budget is an error, not an empty series
        owner, name = _owner_name()
        periods = (
            select(budget_periods.c.id)
            .join(budgets, budgets.c.id == budget_periods.c.budget_id)
            .outerjoin(owner, owner.c.id == budgets.c.slice_of)
            .where(name == budget)
        )
        start = bucket_start(self._store.dialect, bucket, journal.c.created_at).label("bucket")
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
        with self._store.driver.transaction() as cur:
            rows = cur.execute(query).all()
        return [(as_utc(r.bucket), int(r.spent)) for r in rows]

    def provider_usage(
        self, provider: str, *, start: datetime, end: datetime, bucket: str = "1h"
    ) -> list[UsageRow]:
        """What ``provider`` was sent in ``[start, end)`` by window, model and key hint
        (see :func:`.usage.provider_usage`): what the drift check compares."""
        return usage.provider_usage(self._store, provider, start, end, bucket)

    def spend_since(self, since: datetime) -> dict[str, int]:
        """Each budget's spending in its current period since ``since`` (its journal's
        spent deltas), by budget name; budgets with none are left out."""
        since = check.moment(since, "since")
        now = self._store.now()
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
        with self._store.driver.transaction() as cur:
            rows = cur.execute(query).all()
        return {r.budget: int(r.spent) for r in rows if r.spent}

    def settled_stats(self) -> dict[str, SettledStats]:
        """Each budget's attempts settled in its current period (those admitted on it,
        not below it): how many, their estimates and charges, how many were charged
        above their estimate and by how much in all."""
        now = self._store.now()
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
        with self._store.driver.transaction() as cur:
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
            reports.attempt_query()
            .where(attempts.c.state.in_(HOLDING_STATES))
            .order_by(attempts.c.created_at, attempts.c.id)
            .limit(limit)
        )
        with self._store.driver.transaction() as cur:
            return [attempt_of(r) for r in cur.execute(query)]
