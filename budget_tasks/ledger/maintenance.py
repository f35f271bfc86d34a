"""What the periodic side needs from the ledger: flag stale holds, claim unknown
attempts for reconciliation, record what a call was, purge old payloads.

Every claim is made in the database (conditional UPDATEs, SKIP LOCKED), so two beat
processes running the same job at once never act on the same row twice.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from .. import _validate as check
from .._trust import Bound, untrusted_note
from ..errors import InvalidTransition, UnknownAttempt, UnknownOperation, UsageRecorded
from . import escrow
from . import statements as sql
from .base import _bound_params
from .driver import Cursor
from .leases import lease_is_live, this_process
from .operations import Operations, RunEnd
from .oversight import operation_of
from .records import (
    PURGED,
    UNTRUSTED_LOOKUP,
    Attempt,
    CallFacts,
    Hold,
    Operation,
    Purged,
    Resolved,
)
from .reports import Reports
from .schema import operations
from .states import nothing_sent_under

STALE_STATES = ("sending", "unknown")


def _check_resolution(key: str, actual: int, note: str, by: str) -> None:
    check.text(key, "key")
    check.money(actual, "actual")
    check.text(note, "note", max_length=10_000)
    if by not in ("reconcile", "operator"):
        raise ValueError(f"by must be reconcile or operator, not {by!r}")


class Maintenance(Operations, Reports):
    """The maintenance methods of :class:`~budget_tasks.Ledger`."""

    def describe_attempt(
        self,
        key: str,
        *,
        lookup: str | None = None,
        model: str | None = None,
        response_id: str | None = None,
        timeout: float | None = None,
        request: str | None = None,
        bound: Bound | None = None,
    ) -> None:
        """Record what a call is (which lookup finds it, the model it is priced at, the
        provider's response id, the client timeout it is sent with, its request's
        digest, the most tokens it allows), for reconciliation if its outcome becomes
        unknown."""
        check.text(key, "key")
        facts = CallFacts(lookup, model, timeout, request, bound)
        timeout_ms = facts.timeout_ms
        values = {
            name: value
            for name, value in (
                ("lookup", lookup),
                ("model", model),
                ("response_id", response_id),
                ("request_digest", request),
            )
            if value is not None
        }
        if response_id is not None:
            check.text(response_id, "response_id", max_length=255)
        if not values and timeout_ms is None and bound is None:
            return
        params = {
            "key": key,
            "lookup": None,
            "model": None,
            "response_id": None,
            "request_digest": None,
            "timeout_ms": timeout_ms,
            **_bound_params(facts),
            **values,
        }
        with self._driver.transaction() as cur:
            changed = cur.run(sql.DESCRIBE_ATTEMPT, params)
        if not changed:
            raise UnknownAttempt(key)

    def distrust(self, key: str, reason: str) -> bool:
        """Keep unknown attempt ``key`` for an operator: what the provider answered for
        it reports usage past what its request allowed (``reason``). It names no lookup
        any more, so no reconciliation charges that usage as found. False if the attempt
        is no longer unknown (resolved meanwhile)."""
        check.text(key, "key")
        check.text(reason, "reason", max_length=10_000)
        params = {"key": key, "note": untrusted_note(reason), "lookup": UNTRUSTED_LOOKUP}
        with self._driver.transaction() as cur:
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
        idle_since = self._driver.ts(self.now() - idle_for)
        with self._driver.transaction() as cur:
            found = cur.all(
                sql.GRANTS_TO_RETURN, {"true": True, "idle_since": idle_since, "limit": limit}
            )
        back = 0
        for (period_id,) in found:
            with self._driver.transaction() as cur:
                stamp = self._driver.ts(self.now())
                back += escrow.give_back(cur, int(period_id), stamp, "idle", busy_ok=True)
        return back

    def flag_stale(self, older_than: timedelta) -> list[Hold]:
        """Flag, once, every hold in sending/unknown older than ``older_than``; return
        the holds flagged by this call (a concurrent call flags the others)."""
        check.duration(older_than, "older_than", allow_zero=True)
        now = self.now()
        params = {"now": self._driver.ts(now), "cutoff": self._driver.ts(now - older_than)}
        with self._driver.transaction() as cur:
            keys = [row[0] for row in cur.all(sql.FLAG_STALE, params)]
        if not keys:
            return []
        holds: list[Hold] = self.holds(states=STALE_STATES, keys=keys)
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
        now = self.now()
        params = {"limit": limit, "now": self._driver.ts(now)}
        here = this_process()
        with self._driver.transaction() as cur:
            rows = cur.all(sql.ORPHAN_CANDIDATES, params)
            if here is not None:
                # '_' and '%' cannot be in a boot id or an inode number: no escaping
                proof = f"%@{here.boot}/{here.pidns}/%"
                rows += cur.all(sql.ORPHAN_CANDIDATES_HERE, {**params, "proof": proof})
        orphans: list[str] = []
        operations_touched: set[str] = set()
        for key, state, op_key, owner, expires, status, label, amount, recorded in rows:
            expires_at = None if expires is None else self._driver.from_ts(expires)
            if status == "running" and lease_is_live(owner, expires_at, now):
                continue
            try:
                if nothing_sent_under(op_key, label, amount, recorded):
                    self.release(key, "a main attempt of 0: nothing sent under it", expected=state)
                elif state == "sending":
                    # A run that outlives its lease is marked too: its settlement still
                    # lands (settle accepts 'unknown'), and nothing is resent either way.
                    if self.mark_unknown(key, "its run is gone (no live lease): worker lost"):
                        orphans.append(key)
                else:
                    self.release(key, "never sent: its run is gone", expected="reserved")
            except (InvalidTransition, UsageRecorded):
                continue  # moved on since the read: whoever moved it decided
            operations_touched.add(op_key)
        for op_key in operations_touched:
            self.conclude_operation(op_key, fallback="pending")
        return orphans

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
        at 0), then conclude its operation, in one transaction.

        ``by`` is ``reconcile`` or ``operator``; an operator's resolution names
        ``actor`` in the journal (default: the OS user and host). ``answer``
        (reconciliation: what the provider answered) is kept on the attempt for its
        operation to adopt.
        ``expected`` is the state the caller read: the resolution applies only from it
        (compare-and-set). The operation is touched only while this attempt is still
        the latest of its call, the operation is unfinished and no live run leases it;
        when its attempts leave it open it becomes retryable, or, for an operator's
        charge without an answer, failed (the answer is lost)."""
        _check_resolution(key, actual, note, by)
        actor = check.actor(actor) if by == "operator" else None
        encoded = None if answer is None else self._kept(json.dumps(answer))
        now = self.now()
        stamp = self._driver.ts(now)
        state = "released" if actual == 0 and answer is None else "settled"
        kind = "release" if state == "released" else "charge"
        recorded = f"{by}: {note}"
        with self._driver.transaction() as cur:
            position = cur.one(sql.ATTEMPT_POSITION, {"key": key})
            if position is None:
                raise UnknownAttempt(key)
            operation_id, op_key, _label, before, latest = position
            if before == "reserved" and state == "settled":
                raise InvalidTransition(key, before, "charge an attempt that was never sent")
            resolution = self._resolve_in(
                cur,
                key,
                actual,
                state,
                kind,
                recorded,
                stamp,
                expected=expected,
                answer=encoded,
                actor=actor,
            )
            end = None
            if operation_id is not None and latest:
                lost = state == "settled" and answer is None
                end = self._conclude_resolved_in(
                    cur, operation_id, key, actual, recorded, lost, now
                )
            resolution.apply(cur)
        if resolution.applied and actual > resolution.amount:
            self._log_overrun(key, resolution.amount, actual)
        return Resolved(
            key=key,
            applied=resolution.applied,
            state=state if resolution.applied else before,
            actual=resolution.actual,
            amount=resolution.amount,
            operation=op_key,
            operation_status=None if end is None else end.status,
            operation_changed=end is not None and end.applied,
        )

    def _conclude_resolved_in(
        self,
        cur: Cursor,
        operation_id: int,
        key: str,
        actual: int,
        recorded: str,
        lost: bool,
        now: datetime,
    ) -> RunEnd:
        """Conclude the operation of an attempt resolved from outside its run: retryable
        where its attempts leave it open, failed where the charge's answer is lost."""
        error = recorded
        if lost:
            error = (
                f"attempt {key} was charged {actual} and its answer is lost ({recorded}): "
                "the work is not sent again; enqueue it under a new key if it must be done"
            )
        row = self._lock_operation(cur, op_id=operation_id)
        fallback = "failed" if lost else "retryable"
        end: RunEnd = self._conclude_in(cur, row, now, self._driver.ts(now), fallback, error, None)
        return end

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
        now = self.now()
        with self._driver.transaction() as cur:
            rows = cur.all(sql.DUE_FOR_LOOKUP, {"now": self._driver.ts(now), "limit": limit})
            for attempt_id, lookups, _ in rows:
                wait = min(max_backoff, backoff * (2 ** min(lookups, 20)))
                cur.run(
                    sql.PUSH_LOOKUP_BACK,
                    {
                        "lookups": lookups + 1,
                        "next_lookup_at": self._driver.ts(now + wait),
                        "attempt_id": attempt_id,
                    },
                )
        if not rows:
            return []
        claimed: list[Attempt] = self.attempts(keys=[key for _, _, key in rows])
        return claimed

    def operation(self, key: str) -> Operation:
        """One operation by its idempotency key."""
        check.text(key, "idempotency key")
        with self._driver.transaction() as cur:
            r = cur.execute(select(operations).where(operations.c.key == key)).first()
        if r is None:
            raise UnknownOperation(key)
        return operation_of(r)

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
        cutoff = self._driver.ts(self.now() - older_than)
        params = {"cutoff": cutoff, "marker": PURGED, "batch": batch}
        return Purged(
            operations=self._in_batches(sql.PURGE_OPERATIONS, params),
            unfinished=self._in_batches(sql.PURGE_UNFINISHED_PAYLOADS, params),
            side_effects=self._in_batches(sql.PURGE_SIDE_EFFECTS, params),
            attempts=self._in_batches(sql.PURGE_ATTEMPTS, params),
        )
