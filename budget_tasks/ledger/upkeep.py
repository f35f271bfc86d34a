"""What the beat jobs use (``ledger.upkeep``): open periods, flag stale holds, return
idle grants, adopt what dead runs left, claim unknown outcomes for reconciliation and
resolve them, purge old payloads, make and retain the journal's months.

Every claim is made in the database (conditional UPDATEs, SKIP LOCKED), so two beat
processes running the same job at once never act on the same row twice."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from .. import _validate as check
from .._trust import untrusted_note
from ..errors import (
    InvalidTransition,
    RetentionRefused,
    UnknownAttempt,
    UsageRecorded,
)
from . import escrow, holds, maintenance, operations, partitions, rate_takes, reports, retention
from . import statements as sql
from .leases import lease_is_live, this_process
from .operations import RunEnd
from .periods import (
    period_start,
)
from .records import (
    NOTHING_ANSWERED,
    PURGED,
    UNTRUSTED_LOOKUP,
    Answered,
    Attempt,
    Balance,
    Hold,
    PartitionInfo,
    Purged,
    Resolved,
    Retained,
)
from .states import OperationStatus, nothing_sent_under
from .store import Store, epoch_ms


class Upkeep:
    """What the beat jobs use (``ledger.upkeep``; see the module)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"Upkeep({self._store.url!r})"

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._store.url

    def now(self) -> datetime:
        """The ledger's time (see :meth:`~budget_tasks.Ledger.now`)."""
        return self._store.now()

    def provider_key(self, key: str) -> str:
        """What the provider is sent as attempt ``key``'s key (see
        :meth:`~budget_tasks.Ledger.provider_key`)."""
        return self._store.provider_key(key)

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
        answered: Answered = NOTHING_ANSWERED,
    ) -> Resolved:
        """Resolve an attempt from outside its run (see
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
            answered=answered,
        )

    def conclude_operation(
        self,
        key: str,
        *,
        fallback: str = OperationStatus.RETRYABLE,
        error: str | None = None,
        next_reason: str | None = None,
    ) -> RunEnd:
        """Bring an operation no live run holds in line with its attempts (beat and
        operators, after resolving one of its attempts). ``fallback`` (``retryable``,
        ``pending`` or ``failed``) applies when its attempts leave it open."""
        check.text(key, "idempotency key")
        now = self._store.now()
        stamp = self._store.driver.ts(now)
        with self._store.driver.transaction() as cur:
            row = operations.lock_operation(self._store, cur, key=key)
            end: RunEnd = operations.conclude_in(
                self._store, cur, row, now, stamp, fallback, error, next_reason
            )
            return end

    def distrust(self, key: str, reason: str) -> bool:
        """Keep unknown attempt ``key`` for an operator: what the provider answered for
        it reports usage past what its request allowed (``reason``). It names no lookup
        any more, so no reconciliation charges that usage as found. False if the attempt
        is no longer unknown (resolved meanwhile)."""
        check.text(key, "key")
        check.text(reason, "reason", max_length=10_000)
        params = {"key": key, "note": untrusted_note(reason), "lookup": UNTRUSTED_LOOKUP}
        with self._store.driver.transaction() as cur:
            done = cur.one(sql.DISTRUST, params)
            if done is None and cur.one(sql.ATTEMPT_STATE, {"key": key}) is None:
                raise UnknownAttempt(key)
        return done is not None

    def return_grants(self, idle_for: timedelta, *, limit: int = 500) -> int:
        """Give back what escrowed budgets drew and do not use, where their period is
        closed or they have not drawn for ``idle_for``: it is the ancestors' to grant
        again. Each in its own transaction, passing over a budget in the middle of an
        admission. Returns the amount given back."""
        check.duration(idle_for, "idle_for", allow_zero=True)
        check.count(limit, "limit")
        idle_since = self._store.driver.ts(self._store.now() - idle_for)
        with self._store.driver.transaction() as cur:
            found = cur.all(
                sql.GRANTS_TO_RETURN, {"true": True, "idle_since": idle_since, "limit": limit}
            )
        back = 0
        for (period_id,) in found:
            with self._store.driver.transaction() as cur:
                stamp = self._store.driver.ts(self._store.now())
                back += escrow.give_back(cur, int(period_id), stamp, "idle", busy_ok=True)
        return back

    def drop_abandoned_bookings(self, older_than: timedelta = timedelta(hours=1)) -> int:
        """Drop what calls booked on the rate windows and never came back for (the
        message lost, the budget refused it when it did): bookings told to come back
        more than ``older_than`` ago. What they booked goes back to their windows, and
        the calls behind them move up. How many calls' bookings went."""
        now = self._store.now()
        with self._store.driver.transaction() as cur:
            return rate_takes.abandoned_in(cur, epoch_ms(now - older_than), epoch_ms(now))

    def flag_stale(self, older_than: timedelta) -> list[Hold]:
        """Flag, once, every hold in sending/unknown older than ``older_than``; return
        the holds flagged by this call (a concurrent call flags the others)."""
        check.duration(older_than, "older_than", allow_zero=True)
        now = self._store.now()
        params = {
            "now": self._store.driver.ts(now),
            "cutoff": self._store.driver.ts(now - older_than),
        }
        with self._store.driver.transaction() as cur:
            keys = [row[0] for row in cur.all(sql.FLAG_STALE, params)]
        if not keys:
            return []
        holds: list[Hold] = reports.holds_where(
            self._store, states=maintenance.STALE_STATES, keys=keys
        )
        return holds

    def mark_orphans_unknown(self, *, limit: int = 500) -> list[str]:
        """Adopt what runs that are gone left behind (no live lease on their operation:
        a worker died and no delivery came back to say so, e.g. its message was lost
        with the broker): an attempt left ``sending`` becomes ``unknown`` (reconciliation
        then asks the provider), one left ``reserved`` was never sent and is released,
        and the operation is concluded from its attempts. A main attempt of 0 is
        released from either state (see :func:`~.states.nothing_sent_under`). Returns the
        keys made unknown."""
        check.positive(limit, "limit")
        now = self._store.now()
        params = {"limit": limit, "now": self._store.driver.ts(now)}
        here = this_process()
        with self._store.driver.transaction() as cur:
            rows = cur.all(sql.ORPHAN_CANDIDATES, params)
            if here is not None:
                # '_' and '%' cannot be in a boot id or an inode number: no escaping
                proof = f"%@{here.boot}/{here.pidns}/%"
                rows += cur.all(sql.ORPHAN_CANDIDATES_HERE, {**params, "proof": proof})
        orphans: list[str] = []
        operations_touched: set[str] = set()
        for key, state, op_key, owner, expires, status, label, amount, recorded in rows:
            expires_at = None if expires is None else self._store.driver.from_ts(expires)
            if status == "running" and lease_is_live(owner, expires_at, now):
                continue
            try:
                if nothing_sent_under(op_key, label, amount, recorded):
                    holds.release(
                        self._store,
                        key,
                        "a main attempt of 0: nothing sent under it",
                        expected=state,
                    )
                elif state == "sending":
                    # A run that outlives its lease is marked too: its settlement still
                    # lands (settle accepts 'unknown'), and nothing is resent either way.
                    if holds.mark_unknown(
                        self._store, key, "its run is gone (no live lease): worker lost"
                    ):
                        orphans.append(key)
                else:
                    holds.release(
                        self._store, key, "never sent: its run is gone", expected="reserved"
                    )
            except (InvalidTransition, UsageRecorded):
                continue  # moved on since the read: whoever moved it decided
            operations_touched.add(op_key)
        for op_key in operations_touched:
            self.conclude_operation(op_key, fallback="pending")
        return orphans

    def claim_unknown(
        self,
        *,
        limit: int = 50,
        backoff: timedelta = timedelta(minutes=1),
        max_backoff: timedelta = timedelta(hours=6),
    ) -> list[Attempt]:
        """Claim unknown attempts due for a provider lookup, and push each one's next
        lookup back (doubling, up to ``max_backoff``). Rows another claimer holds are
        skipped and a claimed row is not due again before its back-off, so concurrent
        reconcilers do not claim the same attempt at once; a run slower than the
        back-off may see it claimed again and looked up twice. Its settlement is
        compare-and-set, so it is charged once whoever looks it up."""
        check.positive(limit, "limit")
        check.duration(backoff, "backoff")
        check.duration(max_backoff, "max_backoff")
        now = self._store.now()
        with self._store.driver.transaction() as cur:
            rows = cur.all(sql.DUE_FOR_LOOKUP, {"now": self._store.driver.ts(now), "limit": limit})
            for attempt_id, lookups, _ in rows:
                wait = min(max_backoff, backoff * (2 ** min(lookups, 20)))
                cur.run(
                    sql.PUSH_LOOKUP_BACK,
                    {
                        "lookups": lookups + 1,
                        "next_lookup_at": self._store.driver.ts(now + wait),
                        "attempt_id": attempt_id,
                    },
                )
        if not rows:
            return []
        claimed: list[Attempt] = reports.attempts_where(
            self._store, keys=[key for _, _, key in rows]
        )
        return claimed

    def purge_operations(self, older_than: timedelta, *, batch: int = 1_000) -> Purged:
        """Remove every copy of user content older than ``older_than``: results,
        arguments and error text of finished operations, the arguments of unfinished
        ones idle that long, stored answers (labelled calls, ``once``) and resolved
        attempts' answers and notes (see :class:`Purged`). The money stays: attempts'
        amounts and states, and the journal, whose entries never carry error text.

        Each statement runs in batches of ``batch`` rows, each its own transaction,
        through partial indexes of what still holds content: the work grows with what
        is left to purge, not with the history, and no batch holds many row locks."""
        check.duration(older_than, "older_than", allow_zero=True)
        check.positive(batch, "batch")
        cutoff = self._store.driver.ts(self._store.now() - older_than)
        params = {"cutoff": cutoff, "marker": PURGED, "batch": batch}
        return Purged(
            operations=self._store.in_batches(sql.PURGE_OPERATIONS, params),
            unfinished=self._store.in_batches(sql.PURGE_UNFINISHED_PAYLOADS, params),
            side_effects=self._store.in_batches(sql.PURGE_SIDE_EFFECTS, params),
            attempts=self._store.in_batches(sql.PURGE_ATTEMPTS, params),
        )

    def open_period(self, budget: str, at: datetime | None = None) -> Balance:
        """Open (if not yet open) the budget's period containing ``at`` (default: now),
        closing the periods before it: the one just before carries what it left unused
        into it, by the budget's renewal policy."""
        check.text(budget, "budget name", max_length=check.MAX_NAME_LENGTH)
        at = self._store.now() if at is None else check.moment(at, "at")
        budget_id, _, period = self._store.chain(budget)[0]
        self._store.period_id(budget_id, period_start(period, at))  # type: ignore[arg-type]
        return reports.balance(self._store, budget, at=at)

    def audit_size(self, *, full: bool = False) -> int:
        """How many journal rows the next audit reads (a full one: PostgreSQL's
        estimate, where it has one)."""
        with self._store.driver.transaction() as cur:
            if full:
                if not self._store.driver.sqlite:
                    (estimate,) = cur.one(sql.JOURNAL_ROWS_ESTIMATE, {}) or (-1,)
                    if int(estimate) >= 0:
                        return int(estimate)
                (count,) = cur.one(sql.JOURNAL_ROWS, {}) or (0,)
                return int(count)
            row = cur.one(sql.AUDIT_SINCE, {})
            since = 0 if row is None else int(row[0])
            (count,) = cur.one(sql.JOURNAL_ROWS_AFTER, {"since": since}) or (0,)
            return int(count)

    def make_partitions(self, *, ahead: int = partitions.AHEAD) -> list[str]:
        """Make the journal's month partitions from this month to ``ahead`` months
        on, those missing (PostgreSQL; SQLite has none): the names made."""
        check.positive(ahead + 1, "ahead")
        if self._store.driver.sqlite:
            return []
        now = self._store.now()
        with self._store.driver.transaction() as cur:
            return partitions.make_months(cur, now, partitions.ahead_of(now, ahead))

    def retention(self, keep: timedelta | None = None) -> list[PartitionInfo]:
        """Every journal partition and what a retention run with window ``keep``
        would do with it (None: no window, nothing is due), the archived months too."""
        retention.postgresql_only(self._store)
        if keep is not None:
            check.duration(keep, "keep")
        now = self._store.now()
        current = partitions.month_start(now)
        cutoff = None if keep is None else partitions.month_start(now - keep)
        found: list[PartitionInfo] = []
        with self._store.driver.transaction() as cur:
            for name, rows, size in cur.all(partitions.PARTITIONS, {}):
                month = partitions.month_of(name)
                estimate = None if int(rows) < 0 else int(rows)
                blockers: tuple[str, ...] = ()
                if month is None:
                    state = "none" if name == partitions.NONE_PARTITION else "default"
                elif month > current:
                    state = "ahead"
                elif month == current:
                    state = "current"
                elif cutoff is None or partitions.next_month(month) > cutoff:
                    state = "kept"
                else:
                    blockers = retention.blockers(cur, month)
                    state = "blocked" if blockers else "due"
                found.append(PartitionInfo(name, month, state, estimate, int(size), blockers))
            for name, month, count, kept_as in cur.all(sql.ARCHIVES, {}):
                found.append(
                    PartitionInfo(
                        name,
                        self._store.driver.from_ts(month),
                        "archived",
                        int(count),
                        0,
                        (),
                        kept_as,
                    )
                )
        return sorted(found, key=lambda p: (p.month is not None, p.month or now, p.name))

    def retain(self, keep: timedelta, *, archive_to: str | Path, batch: int = 1_000) -> Retained:
        """Archive every month that ended at least ``keep`` ago and is settled (see
        the module) to a directory under ``archive_to``, then remove its attempts and
        the finished operations older than ``keep`` that no attempt names, in batches
        of ``batch`` rows. A month that is not settled is left, and said why."""
        retention.postgresql_only(self._store)
        check.duration(keep, "keep")
        check.positive(batch, "batch")
        if keep < retention.MIN_KEEP:
            raise RetentionRefused(
                f"a retention window under {retention.MIN_KEEP} is refused: {keep}"
            )
        root = Path(archive_to)
        if not root.is_dir():
            raise RetentionRefused(f"the archive directory {str(root)!r} does not exist")
        now = self._store.now()
        cutoff = partitions.month_start(now - keep)
        archived: list[str] = []
        blocked: dict[str, tuple[str, ...]] = {}
        with self._store.driver.transaction() as cur:
            months = [
                month
                for name, _, _ in cur.all(partitions.PARTITIONS, {})
                if (month := partitions.month_of(name)) is not None
                and partitions.next_month(month) <= cutoff
            ]
        for month in sorted(months):
            name = partitions.name_of(month)
            reasons = retention.archive_month(self._store, month, root, now)
            if reasons:
                blocked[name] = reasons
            else:
                archived.append(name)
        params = {"batch": batch, "cutoff": self._store.driver.ts(now - keep)}
        # the attempts of archived periods: their month's export holds them
        attempts = self._store.in_batches(sql.RETAIN_ATTEMPTS, params)
        removed = retention.remove_operations(self._store, params, root)
        return Retained(tuple(archived), blocked, attempts, removed)
