"""The operator's ledger (:class:`Ledger`): budgets, balances, holds and attempts,
operations, resolving an outcome, corrections, the audit; and the other callers'
classes over the same store (``calls``, ``upkeep``, ``views``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Engine,
    select,
)

from .. import _validate as check
from ..errors import (
    BudgetExists,
    CannotReopen,
    CapBelowCommitted,
    InvalidTransition,
    UnknownAttempt,
    UnknownBudget,
    UnknownOperation,
)
from . import audits, escrow, holds, maintenance, oversight, reports
from . import statements as sql
from .budgets import (
    add_slices,
    all_budgets,
    budget_row,
    budget_rows,
    check_escrow,
    check_slices,
    set_frozen,
)
from .calls import CallLedger
from .counters import _apply, _journal
from .operations import attempts_of, lock_operation
from .oversight import OperationHistory, operation_of
from .periods import (
    PERIODS,
    RENEWALS,
    Period,
    Renewal,
    period_start,
)
from .rates import RateLimits
from .records import (
    Attempt,
    AuditFinding,
    Balance,
    BudgetInfo,
    BudgetReport,
    Hold,
    JournalEntry,
    Operation,
    Resolved,
)
from .schema import (
    attempts,
    budget_periods,
    budgets,
    journal,
    operations,
)
from .states import HOLDING, HOLDING_STATES, OperationStatus
from .store import (
    SLICE_MARK,
    Clock,
    Store,
    is_slice_name,
    log,
)
from .upkeep import Upkeep
from .views import Views


class Ledger:
    """A budget ledger on PostgreSQL (``postgresql+psycopg://...``) or SQLite: the
    operator's API. ``calls`` is what sends billable calls uses; ``upkeep``, what the
    beat jobs use; ``views``, what a dashboard reads; all four share one store.

    ``clock`` returns the current time as an aware datetime; tests pass their own to
    move between periods. ``max_stored_bytes`` caps what one stored result or answer
    may take (default: ``BUDGET_TASKS_MAX_STORED_BYTES``, else 1 MiB); past it only its
    digest and size are kept, and a replay of it is refused (AnswerNotKept). Other
    keyword arguments go to SQLAlchemy's ``create_engine``.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        max_stored_bytes: int | None = None,
        **engine_options: Any,
    ) -> None:
        self._store = Store(url, clock=clock, max_stored_bytes=max_stored_bytes, **engine_options)
        self.calls = CallLedger(self._store)
        self.upkeep = Upkeep(self._store)
        self.views = Views(self._store)
        #: the providers' rate limits held across the fleet (:mod:`.rates`)
        self.rates = RateLimits(self._store)

    def __repr__(self) -> str:
        return f"Ledger({self._store.url!r})"

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._store.url

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for reads of your own; every write goes through the
        ledger's methods)."""
        return self._store.engine

    def create_schema(self) -> None:
        """Create the ledger tables if missing (tests, the embedded SQLite default).

        Production PostgreSQL uses the migrations: ``budget-tasks db upgrade``."""
        self._store.create_schema()

    def dispose(self) -> None:
        """Close this ledger's database connections."""
        self._store.dispose()

    def now(self) -> datetime:
        """The current time: the ``clock`` given, else the database's (this host's
        clock corrected by its offset from the database, measured every minute)."""
        return self._store.now()

    def provider_key(self, key: str) -> str:
        """What the provider is sent as attempt ``key``'s key (its Idempotency-Key, a
        stored completion's metadata): an opaque digest of this ledger's installation
        id and the key. A business key may hold a customer's e-mail or a tenant's name:
        it never leaves the ledger; and two ledgers on one API key never share one."""
        return self._store.provider_key(key)

    def budgets(self) -> list[BudgetInfo]:
        """Every budget, by name."""
        return all_budgets(self._store)

    def balance(self, budget: str, *, at: datetime | None = None) -> Balance:
        """The budget's counters for the period containing ``at`` (default: now).

        A read opens nothing: for a period not open yet, it shows what the period would
        open with now (its renewal applied to the period before, as that stands)."""
        return reports.balance(self._store, budget, at=at)

    def report(self) -> list[BudgetReport]:
        """Every budget's current period (cap, spent, held, available, overrun; a
        parent's with what its escrowed tenants and slices spent and hold) and the age
        of its oldest open hold, in one set-based query: what a metrics scrape and
        ``budget-tasks status`` show. A period not open yet shows what it would open
        with; nothing is opened."""
        return reports.report(self._store)

    def holds(
        self,
        *,
        older_than: timedelta | None = None,
        states: Iterable[str] = HOLDING_STATES,
        budget: str | None = None,
        keys: Iterable[str] | None = None,
    ) -> list[Hold]:
        """Attempts still holding money, oldest first, each with its age."""
        return reports.holds_where(
            self._store, older_than=older_than, states=states, budget=budget, keys=keys
        )

    def attempt(self, key: str) -> Attempt:
        """One attempt, with its state, amounts and provider ids."""
        return reports.attempt(self._store, key)

    def attempts(
        self,
        *,
        budget: str | None = None,
        states: Iterable[str] | None = None,
        keys: Iterable[str] | None = None,
    ) -> list[Attempt]:
        """Attempts, oldest first, optionally of one budget, in some states, by key."""
        return reports.attempts_where(self._store, budget=budget, states=states, keys=keys)

    def operations(self, *, status: str | None = None, limit: int = 100) -> list[Operation]:
        """Operations, the most recently changed first, optionally in one status."""
        return oversight.recent_operations(self._store, status=status, limit=limit)

    def operation_history(self, key: str) -> OperationHistory:
        """Operation ``key``, its attempts (oldest first), their journal entries and
        what operators did to it, read in one transaction."""
        return oversight.operation_history(self._store, key)

    def resolve_attempt(
        self,
        key: str,
        actual: int,
        *,
        note: str,
        by: str,
        answer: Any = None,
        expected: str | None = None,
        actor: str | None = None,
    ) -> Resolved:
        """Resolve an attempt from outside its run: settle it at ``actual`` (release it
        at 0), then conclude its operation, in one transaction (see
        :func:`.maintenance.resolve_attempt`)."""
        return maintenance.resolve_attempt(
            self._store,
            key,
            actual,
            note=note,
            by=by,
            answer=answer,
            expected=expected,
            actor=actor,
        )

    def adjust(
        self, key: str, delta: int, reason: str, *, ref: str | None = None, actor: str | None = None
    ) -> bool:
        """Add a provider correction to a settled or released attempt's charge.

        Recorded as a new journal entry, never an overwrite, in the attempt's own
        periods, naming ``actor`` (default: the OS user and host). ``ref`` (e.g. the
        provider's invoice line id) makes the correction idempotent: a second call with
        the same ref returns False. Refused (RetentionRefused) where one of its periods
        lies in a month that retention archived.
        """
        actor = check.actor(actor)
        check.text(key, "key")
        check.money(delta, "delta", signed=True)
        check.text(reason, "reason", max_length=10_000)
        check.optional_text(ref, "ref")
        if delta == 0:
            raise ValueError("an adjustment of 0 records nothing")
        stamp = self._store.driver.ts(self._store.now())
        with self._store.driver.transaction() as cur:
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
            holds.refuse_if_archived(self._store, cur, key, attempt_id)
            (charged,) = cur.one(sql.ATTEMPT_CHARGED, {"attempt_id": attempt_id}) or (0,)
            if charged + delta < 0:
                raise ValueError(
                    f"adjustment {delta} would take attempt {key!r} below zero (charged {charged})"
                )
            for *_, period_id in rows:
                _journal(
                    cur, attempt_id, period_id, "adjustment", 0, delta, reason, stamp, ref, actor
                )
                _apply(cur, sql.APPLY_ADJUSTMENT, {"delta": delta, "period_id": period_id}, stamp)
        return True

    def operation(self, key: str) -> Operation:
        """One operation by its idempotency key."""
        check.text(key, "idempotency key")
        with self._store.driver.transaction() as cur:
            r = cur.execute(select(operations).where(operations.c.key == key)).first()
        if r is None:
            raise UnknownOperation(key)
        return operation_of(r)

    def actions(self, *, budget: str | None = None, limit: int = 100) -> list[JournalEntry]:
        """What operators did (journal rows naming an actor: resolutions, cap changes,
        adjustments, freezes, unfreezes, reopens), the newest first; optionally in
        one budget's periods."""
        check.positive(limit, "limit")
        query = (
            select(journal, attempts.c.key.label("attempt"), budgets.c.name.label("budget"))
            .outerjoin(attempts, attempts.c.id == journal.c.attempt_id)
            .join(budget_periods, budget_periods.c.id == journal.c.period_id)
            .join(budgets, budgets.c.id == budget_periods.c.budget_id)
            .where(journal.c.actor.is_not(None))
            .order_by(journal.c.id.desc())
            .limit(min(limit, oversight.MAX_LISTED))
        )
        if budget is not None:
            name = check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
            query = query.where(budgets.c.name == name)
        with self._store.driver.transaction() as cur:
            rows = cur.execute(query).all()
        return [oversight.entry_of(e) for e in rows]

    def reopen_operation(self, key: str, *, reason: str, by: str | None = None) -> Operation:
        """Reopen failed operation ``key``: it becomes retryable, its dead runs are no
        longer counted, and its next delivery runs it again (labelled calls whose
        results were stored replay; the rest are sent again, as new attempts). Refused
        (:class:`CannotReopen`) unless it failed and none of its calls holds money
        (reserved, in flight or unknown). Recorded as an event, and a journal row (kind
        ``reopen``), naming ``by`` (default: the OS user and host) and ``reason``, in
        the same transaction."""
        check.text(key, "idempotency key")
        check.text(reason, "reason", max_length=10_000)
        by = check.actor(by)
        stamp = self._store.driver.ts(self._store.now())
        with self._store.driver.transaction() as cur:
            row = lock_operation(self._store, cur, key=key)
            if row.status != OperationStatus.FAILED:
                raise CannotReopen(key, f"it is {row.status}; only a failed operation reopens")
            held = [a.key for a in attempts_of(cur, row.id) if a.state in HOLDING]
            if held:
                raise CannotReopen(key, f"its call {held[0]} still holds money; resolve it first")
            to = OperationStatus.RETRYABLE
            params = {"operation_id": row.id, "now": stamp}
            cur.run(sql.REOPEN_OPERATION, {**params, "status": to, "expected": row.status})
            cur.run(
                sql.INSERT_OPERATION_EVENT,
                {
                    **params,
                    "kind": "reopen",
                    "from_status": row.status,
                    "to_status": to,
                    "by": by,
                    "note": reason,
                },
            )
            period = cur.one(sql.LATEST_PERIOD_OF_OPERATION, {"operation_id": row.id})
            if period is not None:
                _journal(cur, None, period[0], "reopen", 0, 0, reason, stamp, key, by)
        return oversight.operation_history(self._store, key).operation

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
        check_slices(slices)
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
        with self._store.driver.transaction() as cur:
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
                check_escrow(cur, name, period, int(parent_id))
            created = cur.one(
                sql.INSERT_BUDGET,
                budget_row(
                    self._store,
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
            add_slices(self._store, cur, int(created[0]), name, period, tenant, 0, slices)
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
        check_slices(slices)
        info = self.budget(name)
        if is_slice_name(name):
            raise ValueError(f"budget {name!r} is a slice: it is not sliced again")
        with self._store.driver.transaction() as cur:
            made = int((cur.one(sql.SLICE_COUNT, {"owner_id": info.id}) or (0,))[0])
            add_slices(self._store, cur, info.id, name, info.period, info.tenant, made, slices)
        with self._store.lock:
            self._store.slice_names.pop(name, None)
        return self.budget(name)

    def budget(self, name: str) -> BudgetInfo:
        """A budget's configuration. Raises UnknownBudget."""
        check.text(name, "budget name", max_length=check.MAX_NAME_LENGTH)
        for info in budget_rows(self._store, budgets.c.name == name):
            return info
        raise UnknownBudget(name)

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
        now = self._store.now()
        budget_id, _, period = self._store.chain(name)[0]
        self._store.period_id(budget_id, period_start(period, now))  # type: ignore[arg-type]
        stamp = self._store.driver.ts(now)
        with self._store.driver.transaction() as cur:
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
        set_frozen(self._store, name, True, note, actor)

    def unfreeze(self, name: str, *, note: str | None = None, actor: str | None = None) -> None:
        """Admit again on this budget (a journal row of kind ``unfreeze``, as a freeze)."""
        set_frozen(self._store, name, False, note, actor)

    def audit(self, *, full: bool = False) -> list[AuditFinding]:
        """Budget periods whose counters differ from their journal; empty when sound.

        Proves the open periods and every period with journal rows since the last
        audit (the first audit, and ``full=True``, read the whole journal and prove
        every period). A closed period changed behind the journal with no journal row
        since is found by a full audit. On PostgreSQL, a journal partition that lost
        rows the audit proved is found by every audit (counter ``rows``, the budget
        named by the partition)."""
        stamp = self._store.driver.ts(self._store.now())
        with self._store.driver.transaction() as cur:
            if not self._store.driver.sqlite:
                cur.run(sql.LOCK_JOURNAL, {})
            (upto,) = cur.one(sql.JOURNAL_END, {}) or (0,)
        with self._store.driver.transaction() as cur:
            cur.run(sql.MAKE_AUDIT_POSITION, {"now": stamp})
            (since,) = cur.one(sql.LOCK_AUDIT_POSITION, {}) or (0,)
            since = int(since)
            first = full or since == 0
            partitioned = not self._store.driver.sqlite and audits.keeps_partitions(
                self._store, cur
            )
            # before this audit records anything: what earlier ones proved is still there
            lost = audits.lost_partitions(self._store, cur) if partitioned else []
            if first:
                cur.run(sql.FORGET_CHECKPOINTS, {})
                cur.run(sql.SEED_CHECKPOINTS, {})
                since = 0
            rows = cur.all(sql.AUDIT_ALL_PERIODS if full else sql.AUDIT_PERIODS, {"since": since})
            # another audit may have moved on meanwhile: never move the position back
            upto = max(int(upto), since)
            span = {"since": since, "upto": upto}
            cur.run(sql.ADVANCE_CHECKPOINTS, span)
            if partitioned:
                cur.run(sql.RECORD_ALL_PARTITIONS if first else sql.RECORD_PARTITIONS, span)
            cur.run(sql.SET_AUDIT_POSITION, {"upto": upto, "now": stamp})
        findings = []
        for name, start, *pairs in rows:
            for i, counter in enumerate(audits.COUNTERS):
                recorded, derived = int(pairs[2 * i]), int(pairs[2 * i + 1])
                if recorded != derived:
                    findings.append(
                        AuditFinding(
                            name, self._store.driver.from_ts(start), counter, recorded, derived
                        )
                    )
        return findings + lost
