"""The ledger's read-only face for a dashboard (``ledger.views``), on PostgreSQL and
SQLite: spend by hour and day from the journal (late charges and corrections
included, in whatever period they land), spend since a moment, settled attempts
against their estimates, open attempts with a limit, an attempt's journal."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from budget_tasks import Ledger
from budget_tasks.errors import UnknownBudget
from budget_tasks.testing import ManualClock


def at(hour: int, minute: int = 0, day: int = 1) -> datetime:
    return datetime(2026, 1, day, hour, minute, tzinfo=UTC)


def test_spend_by_hour_and_day_and_since(ledger: Ledger, clock: ManualClock) -> None:
    ledger.create_budget("org", 1_000_000)
    ledger.create_budget("team", 500_000, period="day", parent="org")
    calls = ledger.calls
    calls.reserve("team", "a", 10_000)  # 12:00 on day 1
    calls.mark_sending("a")
    calls.settle("a", 9_000)
    clock.advance(minutes=50)
    calls.reserve("team", "b", 10_000)  # 12:50
    calls.mark_sending("b")
    clock.advance(minutes=20)
    calls.settle("b", 12_000)  # 13:10: an overrun of 2000
    calls.reserve("team", "c", 4_000)  # reserved, never settled: no spend
    clock.advance(days=1)  # day 2, 13:10: b's period is yesterday's
    ledger.adjust("b", -500, "provider credit")
    views = ledger.views

    hours = views.spend_series("team", since=at(0), bucket="hour")
    assert hours == [(at(12), 9_000), (at(13), 12_000), (at(13, day=2), -500)]
    days = views.spend_series("org", since=at(0), bucket="day")
    assert days == [(at(0), 21_000), (at(0, day=2), -500)]  # the parent's own rows
    assert views.spend_series("team", since=at(13), until=at(14), bucket="hour") == [
        (at(13), 12_000)
    ]
    with pytest.raises(UnknownBudget):
        views.spend_series("nope", since=at(0))
    with pytest.raises(ValueError, match="bucket"):
        views.spend_series("team", since=at(0), bucket="minute")

    # the current periods only: team's correction landed in yesterday's period (b's),
    # org's in its one period for all time
    assert views.spend_since(at(0, day=2)) == {"org": -500}
    assert views.spend_since(at(0)) == {"org": 20_500}  # org has one period for all time
    clock.advance(minutes=5)
    calls.reserve("team", "d", 1_000)
    calls.mark_sending("d")
    calls.settle("d", 1_500)
    # since 13:10 (inclusive): org's correction at 13:10 and d's charge
    assert views.spend_since(at(13, 10, day=2)) == {"org": 1_000, "team": 1_500}

    stats = views.settled_stats()
    assert set(stats) == {"team"}  # attempts are admitted on team, in today's period
    team = stats["team"]
    assert (team.settled, team.estimated, team.charged, team.overruns, team.overrun) == (
        1,
        1_000,
        1_500,
        1,
        500,
    )

    assert [a.key for a in views.open_attempts()] == ["c"]
    assert views.open_attempts(limit=1)[0].amount == 4_000
    entries = views.attempt_journal("b")
    assert [(e.budget, e.kind, e.spent_delta) for e in entries] == [
        ("org", "hold", 0),
        ("team", "hold", 0),
        ("org", "charge", 12_000),
        ("team", "charge", 12_000),
        ("org", "adjustment", -500),
        ("team", "adjustment", -500),
    ]


def test_operation_attempts_by_operation(ledger: Ledger) -> None:
    from budget_tasks.delivery.flow import Delivery, OperationManager
    from budget_tasks.delivery.options import DeliveryOptions

    ledger.create_budget("team", 1_000_000)
    manager = OperationManager(ledger.calls, DeliveryOptions(task="jobs.t"))
    for key in ("op-1", "op-2"):
        manager.deliver(
            Delivery(
                key=key,
                fingerprint="f",
                budget="team",
                estimate=lambda: 100,
                run=lambda scope: scope.record_usage(90),
            )
        )
    found = ledger.views.operation_attempts(["op-2", "op-1", "missing"])
    assert {k: [(a.key, a.actual) for a in v] for k, v in found.items()} == {
        "op-1": [("op-1#1", 90)],
        "op-2": [("op-2#1", 90)],
    }
    assert ledger.views.operation_attempts([]) == {}
    assert timedelta(0) <= ledger.views.now() - ledger.now() <= timedelta(0)
