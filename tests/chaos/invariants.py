"""The checks every chaos test ends with: what the provider saw against what the ledger
holds. Each returns nothing and raises AssertionError with the offending rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider

BILLABLE_METHOD = "POST"
RESOLVED = ("settled", "released")
SLACK_SECONDS = 0.5  # the ledger's and the fake's clocks are the same machine clock


@dataclass(frozen=True)
class AttemptRow:
    key: str
    state: str
    amount: int
    actual: int | None
    sending_at: datetime | None


def attempt_rows(ledger: Ledger) -> dict[str, AttemptRow]:
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT key, state, amount, actual, sending_at FROM attempts")
        ).all()
    return {r.key: AttemptRow(r.key, r.state, r.amount, r.actual, _utc(r.sending_at)) for r in rows}


def _utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def check_requests_match_attempts(ledger: Ledger, fake: FakeProvider) -> int:
    """Every billable request carries an attempt key, each key was sent at most once, and
    its attempt was committed as 'sending' before the request reached the provider.
    Returns the number of billable requests."""
    attempts = attempt_rows(ledger)
    sent = [s for s in fake.served_as(ledger) if s.method == BILLABLE_METHOD]
    keys = Counter(s.idempotency_key for s in sent)
    assert None not in keys, "a billable request without an attempt key"
    repeated = {k: n for k, n in keys.items() if n > 1}
    assert not repeated, f"attempt keys sent more than once: {repeated}"
    for served in sent:
        attempt = attempts.get(str(served.idempotency_key))
        assert attempt is not None, f"request {served.request_id} has no attempt"
        assert attempt.sending_at is not None, f"{attempt.key} sent without being marked sending"
        arrived = datetime.fromtimestamp(served.at, UTC)
        assert (attempt.sending_at - arrived).total_seconds() < SLACK_SECONDS, (
            f"{attempt.key} reached the provider before its reservation committed"
        )
    never_sent_but_billed = [
        a.key for a in attempts.values() if a.state == "settled" and a.key not in keys
    ]
    assert not never_sent_but_billed, f"settled with no request: {never_sent_but_billed}"
    return len(sent)


def check_no_hold_lost(ledger: Ledger, *, quiescent: bool = True) -> None:
    """Each attempt is settled, released, or still holding its amount; the periods hold
    exactly what the holding attempts reserved. With ``quiescent`` (no task running and
    every message delivered), no attempt may be left 'reserved' or 'sending'."""
    attempts = attempt_rows(ledger)
    for a in attempts.values():
        if a.state in RESOLVED:
            assert a.actual is not None and a.actual >= 0, a
        elif quiescent:
            # nothing runs: a hold is either an unknown outcome or left by a task
            # that will not be delivered again (its hold stays until resolved)
            assert a.state == "unknown", f"{a} still in flight after the load ended"
    with ledger.engine.connect() as conn:
        held = conn.execute(
            text(
                "SELECT COALESCE(SUM(held_delta), 0) FROM journal j "
                "JOIN attempts a ON a.id = j.attempt_id "
                "WHERE a.state IN ('reserved', 'sending', 'unknown')"
            )
        ).scalar_one()
        holding = conn.execute(
            text(
                "SELECT COALESCE(SUM(amount), 0) FROM attempts "
                "WHERE state IN ('reserved', 'sending', 'unknown')"
            )
        ).scalar_one()
        counters = conn.execute(
            text("SELECT COALESCE(SUM(held), 0) FROM budget_periods")
        ).scalar_one()
    # one hold entry per period an attempt covers; single-level budgets here
    assert held == holding == counters, (held, holding, counters)


def check_audit_and_caps(ledger: Ledger) -> None:
    """Counters match the journal, and no period has spent plus held past its cap."""
    assert ledger.audit() == []
    with ledger.engine.connect() as conn:
        over = conn.execute(
            text(
                "SELECT b.name, p.cap, p.spent, p.held FROM budget_periods p "
                "JOIN budgets b ON b.id = p.budget_id WHERE p.spent + p.held > p.cap"
            )
        ).all()
        overruns = conn.execute(
            text("SELECT COALESCE(SUM(actual - amount), 0) FROM attempts WHERE actual > amount")
        ).scalar_one()
    # a budget passes its cap only by a recorded overrun, never by admission
    assert not over or overruns > 0, f"admitted past the cap: {over}"


def check_all(ledger: Ledger, fake: FakeProvider) -> int:
    """All of the above; returns the number of billable requests the provider saw."""
    n = check_requests_match_attempts(ledger, fake)
    check_no_hold_lost(ledger)
    check_audit_and_caps(ledger)
    return n
