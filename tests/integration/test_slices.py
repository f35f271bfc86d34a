"""Slices: one budget's money split over rows that share its cap, so that many workers
admitting on one budget do not all write one row. What a user sees (balance, report,
holds, attempts, refusals) is the budget's, as without slices; the cap is exact and a
request that fits is never refused because its slice was short (both backends; races
on PostgreSQL in separate processes)."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from budget_tasks import BudgetExceeded, BudgetFrozen, IdempotencyConflict, Ledger
from budget_tasks.delivery.flow import Delivery, OperationManager
from budget_tasks.delivery.options import DeliveryOptions
from budget_tasks.ledger.schema import budget_periods, budgets
from budget_tasks.testing import ManualClock
from tests.support import race

from .test_concurrency import reserve_many


def rows_used(ledger: Ledger, name: str) -> int:
    """How many of the budget's slices hold or spent anything."""
    owner = ledger.budget(name).id
    with ledger.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(
                    budget_periods.join(budgets, budgets.c.id == budget_periods.c.budget_id)
                )
                .where(budgets.c.slice_of == owner)
                .where(budget_periods.c.spent + budget_periods.c.held > 0)
            ).scalar_one()
        )


def test_a_sliced_budget_admits_to_exactly_its_cap_and_shows_as_one(ledger: Ledger) -> None:
    ledger.create_budget("hot", 1_000, slices=4)
    assert ledger.budget("hot").slices == 4
    assert [b.name for b in ledger.budgets()] == ["hot"]  # slices are not listed
    for i in range(10):
        assert ledger.calls.reserve("hot", f"k{i}", 90).budget == "hot"
    assert rows_used(ledger, "hot") > 1  # the holds went to more than one slice
    for i in range(10):
        ledger.calls.mark_sending(f"k{i}")
        ledger.calls.settle(f"k{i}", 50)
    bal = ledger.balance("hot")
    assert (bal.spent, bal.held, bal.available) == (500, 0, 500)
    # exactly what is left, wherever it sits, is admitted
    ledger.calls.reserve("hot", "all", 500)
    with pytest.raises(BudgetExceeded) as refused:
        ledger.calls.reserve("hot", "one", 1)
    assert (refused.value.budget, refused.value.available) == ("hot", 0)
    [row] = [r for r in ledger.report() if r.budget == "hot"]
    assert (row.spent, row.held, row.available, row.granted) == (500, 500, 0, 0)
    assert [(h.key, h.budget) for h in ledger.holds()] == [("all", "hot")]
    assert ledger.attempt("k3").budget == "hot"
    assert ledger.audit() == []


def test_a_key_reused_on_a_sliced_budget_replays_or_conflicts_as_on_any(ledger: Ledger) -> None:
    ledger.create_budget("hot", 1_000, slices=8)
    first = ledger.calls.reserve("hot", "k", 10, fingerprint="f")
    for _ in range(8):  # whichever slice the next admission takes
        again = ledger.calls.reserve("hot", "k", 10, fingerprint="f")
        assert (again.created, again.budget) == (False, "hot")
    assert first.created
    with pytest.raises(IdempotencyConflict):
        ledger.calls.reserve("hot", "k", 11, fingerprint="f")
    assert ledger.balance("hot").held == 10


def test_slices_are_a_setting_and_names_of_slices_are_reserved(ledger: Ledger) -> None:
    ledger.create_budget("hot", 1_000)
    assert ledger.set_slices("hot", 3).slices == 3
    ledger.calls.reserve("hot", "a", 600)
    assert ledger.set_slices("hot", 1).slices == 1
    ledger.calls.reserve("hot", "b", 400)  # the unused slices' money is taken back
    with pytest.raises(BudgetExceeded):
        ledger.calls.reserve("hot", "c", 1)
    with pytest.raises(ValueError, match="slices"):
        ledger.create_budget("x#slice0", 5)
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="slices must be"):
            ledger.set_slices("hot", bad)  # type: ignore[arg-type]
    assert ledger.audit() == []


def test_a_frozen_sliced_budget_admits_nothing(ledger: Ledger) -> None:
    ledger.create_budget("hot", 100, slices=4)
    ledger.calls.reserve("hot", "k1", 1)
    ledger.freeze("hot")
    with pytest.raises(BudgetFrozen) as frozen:
        ledger.calls.reserve("hot", "k2", 0)
    assert frozen.value.budget == "hot"
    ledger.unfreeze("hot")
    ledger.calls.reserve("hot", "k2", 99)
    assert ledger.audit() == []


def test_a_sliced_budgets_next_period_carries_what_its_slices_left_unused(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("daily", 100, period="day", renewal="rollover", slices=4)
    ledger.calls.reserve("daily", "k1", 30)
    ledger.calls.mark_sending("k1")
    ledger.calls.settle("k1", 10)  # its slice keeps 20 of its grant unused
    assert ledger.balance("daily").available == 90
    clock.advance(days=1)
    ledger.upkeep.open_period("daily")
    # the slices' unused money came back before the carry: all 90 carried
    assert ledger.balance("daily").cap == 190
    ledger.calls.reserve("daily", "k3", 190)
    assert ledger.audit() == []


def test_a_delivery_on_a_sliced_budget_holds_settles_and_replays(pg_ledger: Ledger) -> None:
    pg_ledger.create_budget("team", 5_000, slices=4)
    manager = OperationManager(pg_ledger.calls, DeliveryOptions(task="jobs.t"))
    runs: list[str] = []

    def run(scope: Any) -> str:
        runs.append(scope.key)
        scope.record_usage(300)
        return "done"

    for _ in range(2):
        done = manager.deliver(
            Delivery(key="doc-1", fingerprint="f", budget="team", estimate=lambda: 900, run=run)
        )
        assert done == "done"
    assert len(runs) == 1  # the second delivery replayed
    bal = pg_ledger.balance("team")
    assert (bal.spent, bal.held) == (300, 0)
    [attempt] = pg_ledger.attempts()
    assert attempt.budget == "team"
    assert [a.key for a in pg_ledger.attempts(budget="team")] == [attempt.key]
    assert {e.budget for e in pg_ledger.operation_history("doc-1").journal} == {"team"}
    assert pg_ledger.audit() == []


def test_thirty_two_processes_on_one_budget_in_eight_slices_never_pass_its_cap(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("hot", 40_000, slices=8)
    counts = [63] * 16 + [62] * 16  # 2,000 reservations
    results = [
        row
        for rows in race(reserve_many, [(pg_url, ["hot"], i, n) for i, n in enumerate(counts)])
        for row in rows
    ]
    assert len(results) == 2_000
    admitted = sum(amount for _, _, amount, ok, _ in results if ok)
    assert {by for *_, ok, by in results if not ok} == {"hot"}  # never a slice's name
    bal = pg_ledger.balance("hot")
    assert admitted == bal.held == sum(a.amount for a in pg_ledger.attempts()) <= 40_000
    denied = [amount for _, _, amount, ok, _ in results if not ok]
    assert denied, "the cap was meant to run out"
    # Availability only shrinks here: each refusal was for more than what is left in
    # all the slices and the budget's own row.
    assert min(denied) > bal.available
    assert rows_used(pg_ledger, "hot") == 8
    assert pg_ledger.audit() == []


def churn(url: str, seed: int, count: int) -> int:
    rng = random.Random(seed)
    ledger = Ledger(url)
    done = 0
    try:
        for i in range(count):
            key = f"c{seed}-{i}"
            try:
                ledger.calls.reserve("hot", key, rng.randint(1, 80))
            except BudgetExceeded:
                continue
            ledger.calls.mark_sending(key)
            ledger.calls.settle(key, rng.randint(0, 120))  # overruns too
            if rng.random() < 0.1:
                ledger.upkeep.return_grants(timedelta(0))
            done += 1
    finally:
        ledger.dispose()
    return done


def test_churn_on_a_sliced_budget_has_no_deadlock_and_audits_clean(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("hot", 100_000, slices=8)
    done = race(churn, [(pg_url, seed, 60) for seed in range(32)])
    assert sum(done) > 0
    bal = pg_ledger.balance("hot")
    charged = sum(a.actual or 0 for a in pg_ledger.attempts())
    assert (bal.spent, bal.held) == (charged, 0)
    assert pg_ledger.audit() == []
