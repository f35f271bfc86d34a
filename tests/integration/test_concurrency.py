"""Admission under real concurrency: separate OS processes, each with its own
connection, released together by a barrier."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import timedelta

from budget_tasks import BudgetExceeded, Ledger
from tests.support import race


def reserve_once(url: str, key: str, amount: int) -> bool:
    ledger = Ledger(url)
    try:
        ledger.calls.reserve("shared", key, amount)
        return True
    except BudgetExceeded:
        return False
    finally:
        ledger.dispose()


def test_twenty_processes_reserve_thirty_against_a_cap_of_one_hundred(backend_url: str) -> None:
    Ledger(backend_url).create_budget("shared", 100)
    admitted = race(reserve_once, [(backend_url, f"k{i}", 30) for i in range(20)])
    assert admitted.count(True) == 3
    bal = Ledger(backend_url).balance("shared")
    assert (bal.spent, bal.held) == (0, 90)
    assert Ledger(backend_url).audit() == []


def reserve_many(
    url: str, budgets: list[str], seed: int, count: int
) -> list[tuple[str, str, int, bool, str]]:
    """Reserve ``count`` mixed amounts; report (budget, key, amount, admitted, limiting budget)."""
    rng = random.Random(seed)
    ledger = Ledger(url)
    out = []
    try:
        for i in range(count):
            budget = rng.choice(budgets)
            amount = rng.choice([1, 5, 17, 40, 99, 250])
            key = f"s{seed}-{i}"
            try:
                ledger.calls.reserve(budget, key, amount)
                out.append((budget, key, amount, True, ""))
            except BudgetExceeded as exc:
                out.append((budget, key, amount, False, exc.budget))
    finally:
        ledger.dispose()
    return out


def test_a_thousand_mixed_reservations_never_pass_the_cap(pg_url: str, pg_ledger: Ledger) -> None:
    pg_ledger.create_budget("hot", 20_000)
    counts = [32] * 8 + [31] * 24  # 1,000 reservations from 32 processes
    results = [
        row
        for rows in race(reserve_many, [(pg_url, ["hot"], i, n) for i, n in enumerate(counts)])
        for row in rows
    ]
    assert len(results) == 1000
    admitted = sum(amount for _, _, amount, ok, _ in results if ok)
    bal = pg_ledger.balance("hot")
    assert admitted <= 20_000
    assert bal.held == admitted == sum(a.amount for a in pg_ledger.attempts())
    # Availability only shrinks in this run, so each denial was for more than what is
    # left now: no request was refused while it would have fitted.
    denied = [amount for _, _, amount, ok, _ in results if not ok]
    assert denied, "the cap was meant to run out"
    assert min(denied) > bal.available
    assert pg_ledger.audit() == []


def test_a_parent_smaller_than_its_children_limits_admission(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("tenant", 6_000)
    pg_ledger.create_budget("team-a", 10_000, parent="tenant")
    pg_ledger.create_budget("team-b", 10_000, parent="tenant")
    results = [
        row
        for rows in race(
            reserve_many, [(pg_url, ["team-a", "team-b"], seed, 32) for seed in range(32)]
        )
        for row in rows
    ]
    per_team = {
        team: sum(amount for b, _, amount, ok, _ in results if ok and b == team)
        for team in ("team-a", "team-b")
    }
    tenant = pg_ledger.balance("tenant")
    assert sum(per_team.values()) == tenant.held <= 6_000
    for team, held in per_team.items():
        assert pg_ledger.balance(team).held == held
    assert {limit for *_, ok, limit in results if not ok} == {"tenant"}
    assert min(amount for _, _, amount, ok, _ in results if not ok) > tenant.available
    assert pg_ledger.audit() == []


def churn(
    url: str,
    seed: int,
    count: int,
    budgets: Sequence[str] = ("team-a", "team-b", "tenant"),
    overrun: int = 10,
    returns: float = 0.0,
) -> dict[str, int]:
    """Reserve, send, settle (up to ``overrun`` above the hold), release and adjust
    across ``budgets``, in random order; with ``returns``, that share of the steps also
    has beat give back every unused grant."""
    rng = random.Random(seed)
    ledger = Ledger(url)
    tally = {"admitted": 0, "denied": 0, "settled": 0, "released": 0}
    open_keys: list[tuple[str, int]] = []
    try:
        for i in range(count):
            if open_keys and rng.random() < 0.5:
                key, amount = open_keys.pop(rng.randrange(len(open_keys)))
                ledger.calls.mark_sending(key)
                if rng.random() < 0.7:
                    ledger.calls.settle(key, rng.randint(0, amount + overrun))  # overruns too
                    if rng.random() < 0.2:
                        ledger.adjust(key, rng.randint(1, 5), "late correction")
                    tally["settled"] += 1
                else:
                    ledger.calls.release(key, "provider said 400")
                    tally["released"] += 1
                continue
            if returns and rng.random() < returns:
                ledger.upkeep.return_grants(timedelta(0))
            key = f"c{seed}-{i}"
            amount = rng.randint(1, 60)
            try:
                ledger.calls.reserve(rng.choice(list(budgets)), key, amount)
                open_keys.append((key, amount))
                tally["admitted"] += 1
            except BudgetExceeded:
                tally["denied"] += 1
    finally:
        ledger.dispose()
    return tally


def test_churn_across_a_shared_chain_has_no_deadlock_and_audits_clean(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("tenant", 4_000)
    pg_ledger.create_budget("team-a", 2_500, parent="tenant")
    pg_ledger.create_budget("team-b", 2_500, parent="tenant")
    # A LedgerUnavailable from a deadlock would fail the child and so this race.
    tallies = race(churn, [(pg_url, seed, 60) for seed in range(32)])
    assert sum(t["admitted"] for t in tallies) > 0
    assert sum(t["settled"] + t["released"] for t in tallies) > 0
    assert pg_ledger.audit() == []
    attempts = pg_ledger.attempts()
    for name in ("team-a", "team-b"):
        mine = [a for a in attempts if a.budget == name]
        bal = pg_ledger.balance(name)
        assert bal.held == sum(a.amount for a in mine if a.actual is None)
    tenant = pg_ledger.balance("tenant")
    assert tenant.held == sum(a.amount for a in attempts if a.actual is None)
    # Admission never let held money alone pass a cap (actuals may overrun, holds may not).
    assert tenant.held <= 4_000
