"""What the periodic side needs from the ledger: flag stale holds, claim unknown
attempts for reconciliation, record what a call was, purge old payloads.

Every claim is made in the database (conditional UPDATEs, SKIP LOCKED), so two beat
processes running the same job at once never act on the same row twice.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Engine, select, update

from .. import _validate as check
from ..errors import InvalidTransition, UnknownAttempt, UnknownOperation
from . import statements as sql
from .engine import transaction
from .operations import lease_is_live
from .records import Attempt, Hold, Operation
from .schema import attempts, operations

STALE_STATES = ("sending", "unknown")


class _LedgerBase(Protocol):
    engine: Engine
    _driver: sql.Driver

    def now(self) -> datetime: ...


class MaintenanceMixin:
    """The maintenance methods of :class:`~budget_tasks.Ledger`."""

    def describe_attempt(
        self: _LedgerBase,
        key: str,
        *,
        lookup: str | None = None,
        model: str | None = None,
        response_id: str | None = None,
    ) -> None:
        """Record what a call is (which lookup finds it, the model it is priced at, the
        provider's response id), for reconciliation if its outcome becomes unknown."""
        check.text(key, "key")
        values = {
            name: check.text(value, name, max_length=limit)
            for name, value, limit in (
                ("lookup", lookup, 32),
                ("model", model, 100),
                ("response_id", response_id, 255),
            )
            if value is not None
        }
        if not values:
            return
        params = {"key": key, "lookup": None, "model": None, "response_id": None, **values}
        with self._driver.transaction() as cur:
            changed = cur.run(sql.DESCRIBE_ATTEMPT, params)
        if not changed:
            raise UnknownAttempt(key)

    def flag_stale(self: Any, older_than: timedelta) -> list[Hold]:
        """Flag, once, every hold in sending/unknown older than ``older_than``; return
        the holds flagged by this call (a concurrent call flags the others)."""
        check.duration(older_than, "older_than", allow_zero=True)
        now = self.now()
        with transaction(self.engine) as conn:
            keys = list(
                conn.execute(
                    update(attempts)
                    .where(
                        attempts.c.state.in_(STALE_STATES),
                        attempts.c.created_at <= now - older_than,
                        attempts.c.flagged_at.is_(None),
                    )
                    .values(flagged_at=now)
                    .returning(attempts.c.key)
                ).scalars()
            )
        if not keys:
            return []
        holds: list[Hold] = self.holds(states=STALE_STATES, keys=keys)
        return holds

    def mark_orphans_unknown(self: Any, *, limit: int = 100) -> list[str]:
        """Make 'unknown' every attempt left 'sending' by a run that is gone: its
        operation's lease is not live (the worker died and no delivery came back to say
        so, e.g. its message was lost with the broker). Reconciliation then asks the
        provider about it. Returns the keys it changed."""
        check.positive(limit, "limit")
        now = self.now()
        with transaction(self.engine) as conn:
            rows = conn.execute(
                select(attempts.c.key, operations.c.lease_owner, operations.c.lease_expires_at)
                .join(operations, operations.c.id == attempts.c.operation_id)
                .where(attempts.c.state == "sending")
                .order_by(attempts.c.id)
                .limit(limit)
            ).all()
        orphans = []
        for key, owner, expires in rows:
            # A run that outlives its lease is marked too: its settlement still lands
            # (settle accepts 'unknown'), and nothing is resent either way.
            if not lease_is_live(owner, expires, now):
                try:
                    if self.mark_unknown(key, "its run is gone (no live lease): worker lost"):
                        orphans.append(key)
                except InvalidTransition:
                    pass  # settled or released since the read: nothing to adopt
        return orphans

    def claim_unknown(
        self: Any,
        *,
        limit: int = 50,
        backoff: timedelta = timedelta(minutes=1),
        max_backoff: timedelta = timedelta(hours=6),
    ) -> list[Attempt]:
        """Claim unknown attempts due for a provider lookup, and push each one's next
        lookup back (doubling, up to ``max_backoff``). Rows another claimer holds are
        skipped, so concurrent reconcilers never look up the same attempt at once."""
        check.positive(limit, "limit")
        check.duration(backoff, "backoff")
        check.duration(max_backoff, "max_backoff")
        now = self.now()
        with transaction(self.engine) as conn:
            rows = conn.execute(
                select(attempts.c.id, attempts.c.lookups, attempts.c.key)
                .where(
                    attempts.c.state == "unknown",
                    (attempts.c.next_lookup_at.is_(None)) | (attempts.c.next_lookup_at <= now),
                )
                .order_by(attempts.c.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            ).all()
            for attempt_id, lookups, _ in rows:
                wait = min(max_backoff, backoff * (2 ** min(lookups, 20)))
                conn.execute(
                    update(attempts)
                    .where(attempts.c.id == attempt_id)
                    .values(lookups=lookups + 1, next_lookup_at=now + wait)
                )
        if not rows:
            return []
        claimed: list[Attempt] = self.attempts(keys=[key for _, _, key in rows])
        return claimed

    def operation(self: _LedgerBase, key: str) -> Operation:
        """One operation by its idempotency key."""
        check.text(key, "idempotency key")
        with transaction(self.engine) as conn:
            r = conn.execute(select(operations).where(operations.c.key == key)).first()
        if r is None:
            raise UnknownOperation(key)
        return Operation(
            key=r.key,
            status=r.status,
            task=r.task,
            result=None if r.result is None else json.loads(r.result),
            error=r.error,
            payload=None if r.payload is None else json.loads(r.payload),
            runs=r.runs,
            deliveries=r.deliveries,
            replays=r.replays,
            created_at=r.created_at,
            completed_at=r.completed_at,
            lease_owner=r.lease_owner,
        )

    def purge_operations(self: _LedgerBase, older_than: timedelta) -> int:
        """Drop the stored results and payloads of operations completed longer than
        ``older_than`` ago. Attempts and the journal are kept forever."""
        check.duration(older_than, "older_than", allow_zero=True)
        cutoff = self.now() - older_than
        with transaction(self.engine) as conn:
            done = conn.execute(
                update(operations)
                .where(
                    operations.c.completed_at <= cutoff,
                    (operations.c.result.is_not(None)) | (operations.c.payload.is_not(None)),
                )
                .values(result=None, payload=None)
            )
        return int(done.rowcount)
