"""Escrow: tenants under one parent admit against grants drawn from it, on their own
period rows. The parent's cap stays exact, a frozen parent stops them at once, unused
grants go back, and the journal proves every grant (both backends; races on
PostgreSQL in separate processes)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update

from budget_tasks import BudgetExceeded, BudgetFrozen, Ledger
from budget_tasks.ledger.escrow import GRANT_SHARE
from budget_tasks.ledger.schema import budget_periods, journal
from budget_tasks.testing import ManualClock
from tests.support import race

from .test_concurrency import churn, reserve_many


def journal_rows(ledger: Ledger, budget: str) -> int:
    """How many journal rows the budget's current period has: what writes it."""
    with ledger.engine.connect() as conn:
        period_id = conn.execute(
            select(budget_periods.c.id)
            .where(budget_periods.c.budget_id == ledger.budget(budget).id)
            .order_by(budget_periods.c.period_start.desc())
            .limit(1)
        ).scalar_one()
        return int(
            conn.execute(
                select(func.count()).select_from(journal).where(journal.c.period_id == period_id)
            ).scalar_one()
        )


def row(ledger: Ledger, budget: str) -> tuple[int, int, int, int]:
    """The budget's latest period row as it stands, (spent, held, granted, drawn): what
    its own admissions and its grants wrote, before any roll-up of the budgets below."""
    with ledger.engine.connect() as conn:
        found = conn.execute(
            select(
                budget_periods.c.spent,
                budget_periods.c.held,
                budget_periods.c.granted,
                budget_periods.c.drawn,
            )
            .where(budget_periods.c.budget_id == ledger.budget(budget).id)
            .order_by(budget_periods.c.period_start.desc())
            .limit(1)
        ).one()
    return (int(found[0]), int(found[1]), int(found[2]), int(found[3]))


def unused(ledger: Ledger, name: str) -> int:
    bal = ledger.balance(name)
    return bal.drawn - bal.spent - bal.held


def test_a_tenant_draws_a_share_and_then_admits_and_settles_without_its_parent(
    ledger: Ledger,
) -> None:
    ledger.create_budget("org", 800)
    ledger.create_budget("tenant", 500, parent="org", escrow=True)
    assert ledger.budget("tenant").escrow
    ledger.calls.reserve("tenant", "t1", 10)
    # the first admission drew 1/GRANT_SHARE of what the parent had
    grant = 800 // GRANT_SHARE
    assert ledger.balance("tenant").drawn == grant
    assert row(ledger, "org") == (0, 0, grant, 0)  # the grant is all its row knows
    org = ledger.balance("org")  # the tenant's hold is the parent's too
    assert (org.spent, org.held, org.granted, org.available) == (0, 10, grant - 10, 790)
    parent_rows = journal_rows(ledger, "org")
    # Up to exactly what the grant holds, nothing more reaches the parent's row.
    ledger.calls.reserve("tenant", "t2", grant - 10)
    for key, actual in (("t1", 4), ("t2", grant - 10)):
        ledger.calls.mark_sending(key)
        ledger.calls.settle(key, actual)
    assert journal_rows(ledger, "org") == parent_rows
    assert row(ledger, "org") == (0, 0, grant, 0)
    org = ledger.balance("org")
    assert (org.spent, org.held, org.granted, org.available) == (grant - 6, 0, 6, 806 - grant)
    tenant = ledger.balance("tenant")
    assert (tenant.spent, tenant.held, tenant.drawn) == (grant - 6, 0, grant)
    assert ledger.audit() == []


def test_the_parent_cap_is_exact_and_a_request_that_fits_is_never_refused(
    ledger: Ledger,
) -> None:
    ledger.create_budget("org", 100)
    ledger.create_budget("a", 100, parent="org", escrow=True)
    ledger.create_budget("b", 100, parent="org", escrow=True)
    ledger.calls.reserve("a", "a1", 5)
    assert unused(ledger, "a") == 100 // GRANT_SHARE - 5  # a holds some grant unused
    # b asks for exactly what is left in all: it takes back what a does not use
    ledger.calls.reserve("b", "b1", 95)
    assert unused(ledger, "a") == 0
    with pytest.raises(BudgetExceeded) as refused:
        ledger.calls.reserve("a", "a2", 1)
    assert (refused.value.budget, refused.value.available) == ("org", 0)
    assert row(ledger, "org")[2] == 100
    org = ledger.balance("org")
    assert (org.held, org.granted, org.available) == (100, 0, 0)
    assert ledger.balance("a").held + ledger.balance("b").held == 100
    assert ledger.audit() == []


def test_a_charge_above_the_grant_draws_the_rest_from_the_parent_at_once(
    ledger: Ledger,
) -> None:
    ledger.create_budget("org", 80)
    ledger.create_budget("a", 100, parent="org", escrow=True)
    ledger.calls.reserve("a", "a1", 10)  # draws 10 (80 // 8)
    ledger.calls.mark_sending("a1")
    ledger.calls.settle("a1", 25)
    a, org = ledger.balance("a"), ledger.balance("org")
    assert (a.spent, a.drawn, a.drawn - a.spent) == (25, 25, 0)
    assert (org.spent, org.granted, org.available) == (25, 0, 55)
    assert row(ledger, "org")[2] == 25
    # a provider correction upward draws too
    ledger.adjust("a1", 5, "invoice line")
    assert (ledger.balance("a").drawn, ledger.balance("org").available) == (30, 50)
    assert ledger.audit() == []


def test_a_frozen_parent_stops_a_tenant_that_still_holds_a_grant(ledger: Ledger) -> None:
    ledger.create_budget("org", 800)
    ledger.create_budget("a", 800, parent="org", escrow=True)
    ledger.calls.reserve("a", "a1", 1)
    assert unused(ledger, "a") > 0
    ledger.freeze("org")
    with pytest.raises(BudgetFrozen) as frozen:
        ledger.calls.reserve("a", "a2", 1)
    assert frozen.value.budget == "org"
    # the freeze took back what the tenant did not use
    assert unused(ledger, "a") == 0
    assert row(ledger, "org")[2] == 1
    org = ledger.balance("org")
    assert (org.held, org.granted, org.available) == (1, 0, 799)
    ledger.unfreeze("org")
    ledger.calls.reserve("a", "a2", 1)
    assert ledger.audit() == []


def test_unused_grants_go_back_at_period_end_and_when_the_tenant_is_idle(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("org", 1_600)
    ledger.create_budget("a", 1_000, period="day", parent="org", escrow=True)
    ledger.calls.reserve("a", "a1", 10)
    ledger.calls.mark_sending("a1")
    ledger.calls.settle("a1", 10)
    assert row(ledger, "org")[2] == 200
    assert ledger.balance("org").granted == 190  # unused below: available
    clock.advance(days=1)
    # the next day's first admission closes the day before: its 190 unused go back
    ledger.calls.reserve("a", "a2", 10)
    assert row(ledger, "org")[2] == 10 + (1_600 - 10) // GRANT_SHARE
    org = ledger.balance("org")
    assert (org.spent, org.held, org.granted) == (10, 10, (1_600 - 10) // GRANT_SHARE - 10)
    # a tenant that has not drawn for a while gives back the rest (beat)
    clock.advance(minutes=4)
    assert ledger.upkeep.return_grants(timedelta(minutes=5)) == 0
    clock.advance(minutes=2)
    back = ledger.upkeep.return_grants(timedelta(minutes=5))
    assert back == org.granted
    assert row(ledger, "org")[2] == 20  # 10 spent yesterday, 10 held today
    org = ledger.balance("org")
    assert (org.spent, org.held, org.granted, org.available) == (10, 10, 0, 1_580)
    assert ledger.audit() == []


def test_escrow_needs_a_parent_whose_periods_contain_the_tenants(ledger: Ledger) -> None:
    ledger.create_budget("month", 100, period="month")
    with pytest.raises(ValueError, match="escrow needs a parent"):
        ledger.create_budget("alone", 10, escrow=True)
    with pytest.raises(ValueError, match="must contain"):
        ledger.create_budget("weekly", 10, period="week", parent="month", escrow=True)
    with pytest.raises(ValueError, match="must contain"):
        ledger.create_budget("forever", 10, parent="month", escrow=True)
    ledger.create_budget("daily", 10, period="day", parent="month", escrow=True)
    ledger.create_budget("monthly", 10, period="month", parent="month", escrow=True)
    assert {b.name for b in ledger.budgets() if b.escrow} == {"daily", "monthly"}


def test_the_audit_proves_grants_from_the_journal(ledger: Ledger) -> None:
    ledger.create_budget("org", 800)
    ledger.create_budget("a", 800, parent="org", escrow=True)
    ledger.calls.reserve("a", "a1", 1)
    assert ledger.audit() == []
    org_id = ledger.budget("org").id
    with ledger.engine.begin() as conn:
        conn.execute(
            update(budget_periods)
            .where(budget_periods.c.budget_id == org_id)
            .values(granted=budget_periods.c.granted - 1)
        )
    assert [(f.budget, f.counter, f.journal - f.recorded) for f in ledger.audit()] == [
        ("org", "granted", 1)
    ]


# -- races: separate processes, each its own connection -----------------------------------


def test_thirty_two_processes_across_escrowed_tenants_never_pass_the_parent_cap(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("org", 30_000)
    tenants = [f"t{i}" for i in range(8)]
    for name in tenants:
        pg_ledger.create_budget(name, 5_000, parent="org", escrow=True)
    counts = [63] * 16 + [62] * 16  # 2,000 reservations from 32 processes
    results = [
        row
        for rows in race(reserve_many, [(pg_url, tenants, i, n) for i, n in enumerate(counts)])
        for row in rows
    ]
    assert len(results) == 2_000
    admitted = sum(amount for _, _, amount, ok, _ in results if ok)
    org = pg_ledger.balance("org")
    held = {name: pg_ledger.balance(name).held for name in tenants}
    assert admitted == sum(held.values()) == sum(a.amount for a in pg_ledger.attempts())
    # the cap is exact: grants (used or not) count against it, and never pass it
    spent, held_on_org, granted, _ = row(pg_ledger, "org")
    assert admitted <= granted <= 30_000
    assert spent == held_on_org == 0
    left = {name: unused(pg_ledger, name) for name in tenants}
    assert granted == admitted + sum(left.values())
    # the parent shows its tenants' holds, and their unused grants as available
    assert (org.spent, org.held, org.granted) == (0, admitted, sum(left.values()))
    assert org.available == 30_000 - admitted
    # Availability only shrinks here: a refusal by the parent was for more than what
    # is left in all (the parent and every tenant's unused grant); one by a tenant, for
    # more than its own cap leaves.
    by_org = [amount for _, _, amount, ok, by in results if not ok and by == "org"]
    assert by_org, "the parent's cap was meant to run out"
    assert min(by_org) > org.available
    for name in tenants:
        mine = [a for _, _, a, ok, by in results if not ok and by == name]
        if mine:
            assert min(mine) > pg_ledger.balance(name).available
    # the grants were drawn far fewer times than admissions were made
    with pg_ledger.engine.connect() as conn:
        grants = conn.execute(
            select(func.count()).select_from(journal).where(journal.c.kind == "grant")
        ).scalar_one()
    assert grants < sum(1 for *_, ok, _ in results if ok) / 2
    assert pg_ledger.audit() == []


def test_churn_with_overruns_and_returns_has_no_deadlock_and_audits_clean(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("org", 6_000)
    for name in ("a", "b", "c"):
        pg_ledger.create_budget(name, 3_000, parent="org", escrow=True)
    # a deadlock or a check violation would fail a child, and so the race
    budgets = ["a", "b", "c", "org"]
    tallies = race(churn, [(pg_url, seed, 80, budgets, 40, 0.05) for seed in range(32)])
    assert sum(t["admitted"] for t in tallies) > 0
    assert sum(t["settled"] + t["released"] for t in tallies) > 0
    assert pg_ledger.audit() == []
    attempts = pg_ledger.attempts()
    org = pg_ledger.balance("org")
    consumed = 0
    for name in ("a", "b", "c"):
        bal = pg_ledger.balance(name)
        mine = [a for a in attempts if a.budget == name]
        assert bal.held == sum(a.amount for a in mine if a.actual is None)
        assert bal.drawn >= bal.spent + bal.held  # never admitted past its grant
        consumed += bal.drawn
    _, held_on_org, granted, _ = row(pg_ledger, "org")
    assert granted == consumed
    direct = [a for a in attempts if a.budget == "org"]
    assert held_on_org == sum(a.amount for a in direct if a.actual is None)
    # Holds never passed the cap (actuals may overrun it; holds may not).
    tenants_held = sum(a.amount for a in attempts if a.actual is None and a.budget != "org")
    assert held_on_org + tenants_held <= 6_000
    # the parent's figures are its whole tree's
    assert org.held == held_on_org + tenants_held
    tenants_spent = sum(pg_ledger.balance(name).spent for name in ("a", "b", "c"))
    assert org.spent == row(pg_ledger, "org")[0] + tenants_spent


def test_a_call_on_the_parent_itself_takes_back_what_its_tenants_do_not_use(
    ledger: Ledger,
) -> None:
    # found by the ledger state machine: a direct admission on the parent was refused
    # while a tenant held a grant it did not use
    ledger.create_budget("org", 300)
    ledger.create_budget("team", 300, parent="org")  # no escrow: holds on org directly
    ledger.create_budget("crew", 90, parent="org", escrow=True)
    ledger.calls.reserve("crew", "c1", 48)
    ledger.calls.release("c1", "not billed")  # crew keeps its 48 of grant, unused
    ledger.calls.reserve("org", "o1", 133)
    ledger.calls.reserve("team", "t1", 167)  # exactly what is left in all
    assert unused(ledger, "crew") == 0
    org = ledger.balance("org")
    assert (org.held, org.granted, org.available) == (300, 0, 0)
    assert ledger.audit() == []


def test_a_parent_past_its_cap_by_an_overrun_stops_a_tenant_with_grant_left(
    ledger: Ledger,
) -> None:
    # found by the ledger state machine: the tenant spent a grant that an overrun on
    # its parent had already spent
    ledger.create_budget("org", 300)
    ledger.create_budget("crew", 90, parent="org", escrow=True)
    ledger.calls.reserve("crew", "c1", 48)
    ledger.calls.release("c1", "not billed")  # crew keeps 48 of grant, unused
    ledger.calls.reserve("org", "o1", 128)
    ledger.calls.mark_sending("o1")
    ledger.calls.settle("o1", 287)  # an overrun: org is at 287 + 48 granted = 35 past
    with pytest.raises(BudgetExceeded) as refused:
        ledger.calls.reserve("crew", "c2", 43)
    assert (refused.value.budget, refused.value.available) == ("org", 13)
    ledger.calls.reserve("crew", "c3", 13)  # what is truly left, exactly
    with pytest.raises(BudgetExceeded):
        ledger.calls.reserve("crew", "c4", 1)
    assert ledger.audit() == []


def test_an_admission_chosen_to_break_a_deadlock_runs_again(pg_url: str, pg_ledger: Ledger) -> None:
    """A real deadlock: this transaction locks b's period then waits for a's, which
    another session holds and then asks for b's. PostgreSQL aborts the one that waited
    longer (this one): it runs again, and succeeds once the other commits."""
    import threading

    import psycopg

    from ..services import pg_conninfo

    for name in ("a", "b"):
        pg_ledger.create_budget(name, 1_000)
        pg_ledger.upkeep.open_period(name)
    with pg_ledger.engine.connect() as conn:
        ids = dict(conn.execute(text(
            "SELECT b.name, p.id FROM budget_periods p JOIN budgets b ON b.id = p.budget_id"
        )).all())  # fmt: skip
    other = psycopg.connect(pg_conninfo(pg_url))
    other.execute("UPDATE budget_periods SET cap = cap WHERE id = %s", (ids["a"],))
    core = pg_ledger._store  # the retry under every admission
    runs: list[int] = []

    def body() -> str:
        runs.append(len(runs))
        with core.driver.transaction() as cur:
            cur.one("SELECT id FROM budget_periods WHERE id = :id FOR UPDATE", {"id": ids["b"]})
            cur.one("SELECT id FROM budget_periods WHERE id = :id FOR UPDATE", {"id": ids["a"]})
            return "admitted"

    def the_other() -> None:
        time.sleep(0.3)  # after this one waits for a's row
        other.execute("UPDATE budget_periods SET cap = cap WHERE id = %s", (ids["b"],))
        time.sleep(0.3)
        other.commit()

    closer = threading.Thread(target=the_other)
    closer.start()
    assert core.deadlock_retried(body) == "admitted"
    closer.join()
    other.close()
    assert runs == [0, 1]  # aborted once by the deadlock, then through
