"""Ledger behaviour on both backends (PostgreSQL and SQLite)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from budget_tasks import (
    BudgetExceeded,
    BudgetExists,
    BudgetFrozen,
    CallFacts,
    IdempotencyConflict,
    Ledger,
    SettlementConflict,
    UnknownAttempt,
    UnknownBudget,
)
from budget_tasks.errors import InvalidTransition
from budget_tasks.testing import ManualClock


def sent(ledger: Ledger, budget: str, key: str, amount: int) -> None:
    ledger.calls.reserve(budget, key, amount)
    ledger.calls.mark_sending(key, provider="openai")


def test_reserve_holds_and_settle_replaces_the_hold(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    r = ledger.calls.reserve("acme", "k1", 40, fingerprint="fp")
    assert r.created and r.amount == 40 and r.state == "reserved"
    assert (ledger.balance("acme").held, ledger.balance("acme").spent) == (40, 0)
    ledger.calls.mark_sending("k1", provider="openai", request_id="req_1")
    assert ledger.calls.settle("k1", 25) is True
    bal = ledger.balance("acme")
    assert (bal.cap, bal.spent, bal.held, bal.available) == (100, 25, 0, 75)
    a = ledger.attempt("k1")
    assert (a.state, a.actual, a.provider, a.request_id, a.overrun) == (
        "settled",
        25,
        "openai",
        "req_1",
        0,
    )


def test_same_key_replays_without_a_second_hold(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k1", 40, fingerprint="fp")
    again = ledger.calls.reserve("acme", "k1", 40, fingerprint="fp")
    assert again.created is False
    assert ledger.balance("acme").held == 40
    ledger.calls.mark_sending("k1")
    ledger.calls.settle("k1", 40)
    # Even when the budget is full and the attempt long settled, the key replays.
    assert ledger.calls.reserve("acme", "k1", 40, fingerprint="fp").state == "settled"
    assert ledger.balance("acme").spent == 40


@pytest.mark.parametrize(
    ("budget", "amount", "fingerprint", "field"),
    [
        ("acme", 41, "fp", "amount"),
        ("acme", 40, "other", "fingerprint"),
        ("acme", 40, None, "fingerprint"),
        ("beta", 40, "fp", "budget"),
    ],
)
def test_key_reuse_with_another_request_is_a_conflict(
    ledger: Ledger, budget: str, amount: int, fingerprint: str | None, field: str
) -> None:
    ledger.create_budget("acme", 100)
    ledger.create_budget("beta", 100)
    ledger.calls.reserve("acme", "k1", 40, fingerprint="fp")
    with pytest.raises(IdempotencyConflict) as info:
        ledger.calls.reserve(budget, "k1", amount, fingerprint=fingerprint)
    assert info.value.field == field
    assert ledger.balance("acme").held == 40 and ledger.balance("beta").held == 0


def test_admission_is_exact_at_the_cap(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "a", 60)
    ledger.calls.reserve("acme", "b", 40)  # spent + held + amount == cap is admitted
    with pytest.raises(BudgetExceeded) as info:
        ledger.calls.reserve("acme", "c", 1)
    assert (info.value.budget, info.value.requested, info.value.available) == ("acme", 1, 0)
    with pytest.raises(UnknownAttempt):
        ledger.attempt("c")  # the refused attempt left no row


def test_parent_limits_the_child(ledger: Ledger) -> None:
    ledger.create_budget("tenant", 50)
    ledger.create_budget("project", 100, parent="tenant")
    ledger.calls.reserve("project", "a", 30)
    with pytest.raises(BudgetExceeded) as info:
        ledger.calls.reserve("project", "b", 30)
    assert info.value.budget == "tenant" and info.value.available == 20
    assert ledger.balance("project").held == 30
    assert ledger.balance("tenant").held == 30
    sent(ledger, "project", "c", 20)
    ledger.calls.settle("c", 5)
    assert (ledger.balance("tenant").spent, ledger.balance("tenant").held) == (5, 30)
    assert (ledger.balance("project").spent, ledger.balance("project").held) == (5, 30)


def test_frozen_budget_or_ancestor_admits_nothing_but_settles(ledger: Ledger) -> None:
    ledger.create_budget("tenant", 500)
    ledger.create_budget("project", 100, parent="tenant")
    sent(ledger, "project", "a", 10)
    ledger.freeze("tenant")
    with pytest.raises(BudgetFrozen) as info:
        ledger.calls.reserve("project", "b", 10)
    assert info.value.budget == "tenant"
    assert ledger.calls.settle("a", 10)  # money already out still settles
    ledger.unfreeze("tenant")
    ledger.calls.reserve("project", "b", 10)
    assert ledger.budget("tenant").frozen is False
    with pytest.raises(UnknownBudget):
        ledger.freeze("nope")


def test_settle_twice_same_actual_is_a_no_op_other_actual_conflicts(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    sent(ledger, "acme", "k", 50)
    assert ledger.calls.settle("k", 30) is True
    assert ledger.calls.settle("k", 30) is False
    with pytest.raises(SettlementConflict) as info:
        ledger.calls.settle("k", 31)
    assert (info.value.recorded, info.value.requested) == (30, 31)
    with pytest.raises(SettlementConflict):
        ledger.calls.release("k", "changed my mind")
    assert ledger.balance("acme").spent == 30


def test_overrun_is_recorded_as_it_is(ledger: Ledger, caplog: pytest.LogCaptureFixture) -> None:
    ledger.create_budget("acme", 100)
    sent(ledger, "acme", "k", 50)
    ledger.calls.settle("k", 70)
    assert ledger.balance("acme").spent == 70
    assert ledger.attempt("k").overrun == 20
    assert "overrun on attempt k" in caplog.text


def test_release_returns_the_hold(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "never-sent", 50)
    sent(ledger, "acme", "rejected", 50)
    assert ledger.calls.release("never-sent", "worker stopped before sending")
    assert ledger.calls.release("rejected", "provider answered 400")
    assert ledger.calls.release("rejected", "again") is False
    bal = ledger.balance("acme")
    assert (bal.held, bal.spent) == (0, 0)
    assert ledger.attempt("rejected").note == "provider answered 400"


def test_one_attempt_grants_one_send(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    sent(ledger, "acme", "k", 50)
    with pytest.raises(InvalidTransition):
        ledger.calls.mark_sending("k")
    with pytest.raises(UnknownAttempt):
        ledger.calls.mark_sending("nope")


def test_a_reservation_that_grants_is_sending_and_described_at_once(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    facts = CallFacts("openai.chat", "gpt-4o-mini", 2.5)
    reservation = ledger.calls.reserve("acme", "k", 100, grant=facts)  # exactly what is left
    assert (reservation.state, reservation.created) == ("sending", True)
    attempt = ledger.attempt("k")
    assert (attempt.state, attempt.lookup, attempt.model) == (
        "sending",
        "openai.chat",
        "gpt-4o-mini",
    )
    assert attempt.timeout_ms == 2_500 and attempt.sending_at is not None
    with pytest.raises(InvalidTransition):  # the grant was given once, with the hold
        ledger.calls.mark_sending("k")
    with pytest.raises(BudgetExceeded):  # nothing left: no second grant either
        ledger.calls.reserve("acme", "k2", 1, grant=CallFacts())
    assert ledger.holds(keys=["k2"]) == [] and ledger.balance("acme").held == 100
    assert ledger.calls.settle("k", 60, request_id="req_9", response_id="chatcmpl_9")
    settled = ledger.attempt("k")
    assert (settled.state, settled.actual, settled.request_id) == ("settled", 60, "req_9")
    assert settled.response_id == "chatcmpl_9"
    assert ledger.audit() == []


def test_settle_needs_a_send_first(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k", 50)
    with pytest.raises(InvalidTransition):
        ledger.calls.settle("k", 50)
    assert ledger.balance("acme").held == 50


def test_unknown_outcome_keeps_the_hold_then_settles(ledger: Ledger, clock: ManualClock) -> None:
    ledger.create_budget("acme", 100)
    sent(ledger, "acme", "k", 50)
    ledger.calls.record_request_id("k", "req_9")
    assert ledger.calls.mark_unknown("k", "read timeout") is True
    assert ledger.calls.mark_unknown("k", "read timeout") is False
    clock.advance(hours=3)
    [hold] = ledger.holds(older_than=timedelta(hours=2))
    assert (hold.key, hold.state, hold.amount, hold.request_id) == ("k", "unknown", 50, "req_9")
    assert hold.age == timedelta(hours=3)
    assert ledger.holds(older_than=timedelta(hours=4)) == []
    assert ledger.balance("acme").held == 50
    assert ledger.calls.settle("k", 42)
    assert ledger.holds() == []


def test_request_id_is_recorded_once(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k", 10)
    with pytest.raises(InvalidTransition):
        ledger.calls.record_request_id("k", "req_1")  # nothing was sent yet
    ledger.calls.mark_sending("k")
    ledger.calls.record_request_id("k", "req_1")
    ledger.calls.record_request_id("k", "req_1")
    with pytest.raises(InvalidTransition):
        ledger.calls.record_request_id("k", "req_2")
    assert ledger.attempt("k").request_id == "req_1"


def test_adjust_is_a_journal_entry_idempotent_by_ref(ledger: Ledger) -> None:
    ledger.create_budget("tenant", 1000)
    ledger.create_budget("acme", 100, parent="tenant")
    sent(ledger, "acme", "k", 50)
    with pytest.raises(InvalidTransition):
        ledger.adjust("k", 5, "too early")
    ledger.calls.settle("k", 40)
    assert ledger.adjust("k", 7, "provider correction", ref="inv-1") is True
    assert ledger.adjust("k", 7, "provider correction", ref="inv-1") is False
    assert ledger.adjust("k", -3, "refund") is True
    assert ledger.balance("acme").spent == 44 and ledger.balance("tenant").spent == 44
    with pytest.raises(ValueError, match="below zero"):
        ledger.adjust("k", -45, "too much")
    with pytest.raises(ValueError, match="adjustment of 0"):
        ledger.adjust("k", 0, "nothing")
    assert ledger.attempt("k").actual == 40  # the settlement itself is never rewritten
    assert ledger.audit() == []


def test_late_settlement_charges_the_period_of_admission(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("daily", 100, period="day")
    sent(ledger, "daily", "k", 60)
    day1 = ledger.balance("daily").period_start
    clock.advance(days=1)
    fresh = ledger.balance("daily")
    assert fresh.period_start == day1 + timedelta(days=1)
    assert (fresh.held, fresh.spent, fresh.available) == (0, 0, 100)
    ledger.calls.settle("k", 55)
    assert ledger.balance("daily").spent == 0
    old = ledger.balance("daily", at=day1)
    assert (old.spent, old.held) == (55, 0)
    assert ledger.attempt("k").period_start == day1
    assert ledger.audit() == []


def test_rollover_renewal_carries_unused_up_to_the_ceiling(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("daily", 100, period="day", renewal="rollover", rollover_ceiling=250)
    ledger.create_budget("plain", 100, period="day")
    for name in ("daily", "plain"):
        sent(ledger, name, f"{name}-1", 30)
        ledger.calls.settle(f"{name}-1", 30)
    clock.advance(days=1)
    assert ledger.balance("daily").cap == 170  # what it would open with: 100 + 70 unused
    assert ledger.upkeep.open_period("daily").cap == 170  # opened (closing day 1): the same
    assert ledger.upkeep.open_period("plain").cap == 100  # reset
    clock.advance(days=1)
    assert ledger.upkeep.open_period("daily").cap == 250  # 100 + 170, capped at 250


def test_duplicate_and_unknown_budgets(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    with pytest.raises(BudgetExists):
        ledger.create_budget("acme", 100)
    with pytest.raises(UnknownBudget):
        ledger.create_budget("child", 10, parent="nope")
    with pytest.raises(UnknownBudget):
        ledger.calls.reserve("nope", "k", 1)
    with pytest.raises(UnknownBudget):
        ledger.balance("nope")
    assert [b.name for b in ledger.budgets()] == ["acme"]


def test_audit_finds_a_counter_changed_behind_the_journal(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k", 10)
    assert ledger.audit() == []
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE budget_periods SET held = held - 10"))
    [finding] = ledger.audit()
    assert (finding.budget, finding.counter, finding.recorded, finding.journal) == (
        "acme",
        "held",
        0,
        10,
    )


def test_journal_is_append_only(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k", 10)
    for statement in ("UPDATE journal SET held_delta = 0", "DELETE FROM journal"):
        with pytest.raises(DBAPIError, match="append-only"), ledger.engine.begin() as conn:
            conn.execute(text(statement))
    assert ledger.balance("acme").held == 10 and ledger.audit() == []


def test_the_price_table_version_is_stored_with_the_attempt(ledger: Ledger) -> None:
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k", 10, price_version="2026-11-01")
    ledger.calls.reserve("acme", "plain", 10)
    assert ledger.attempt("k").price_version == "2026-11-01"
    assert ledger.attempt("plain").price_version is None


def test_a_forked_child_opens_its_own_connections_and_leaves_the_parents_alone(
    ledger: Ledger,
) -> None:
    """Celery's prefork pool forks children from a process that used the ledger (the
    schema created, a period opened, a scrape). The child must use connections of its
    own, and the parent's must still work after the child is gone."""
    import os

    ledger.create_budget("forked", 10_000, period="day")
    ledger.calls.reserve("forked", "parent-1", 100)  # both paths used: driver and engine
    assert ledger.budgets()
    pid = os.fork()
    if pid == 0:  # the child: any failure is its exit status
        code = 1
        try:
            child = ledger
            child.calls.reserve("forked", "child-1", 100)
            child.calls.mark_sending("child-1")
            child.calls.settle("child-1", 60)
            assert child.balance("forked").spent == 60
            assert [b.name for b in child.budgets()] == ["forked"]
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    ledger.calls.reserve("forked", "parent-2", 100)
    assert (ledger.balance("forked").spent, ledger.balance("forked").held) == (60, 200)
    assert ledger.audit() == []


def test_the_report_agrees_with_balances_and_holds_in_one_query(
    ledger: Ledger, clock: ManualClock
) -> None:
    """report() (what a scrape and `status` show) against balance() and holds(), budget
    by budget: open periods, a period not open yet (what it would open with, rollover
    included, and nothing opened by the read), a frozen budget, open holds' ages."""
    ledger.create_budget("flat", 1_000)
    ledger.create_budget("daily", 500, period="day", renewal="rollover", rollover_ceiling=900)
    ledger.create_budget("weekly", 700, period="week", parent="flat")
    ledger.create_budget("monthly", 300, period="month")
    ledger.create_budget("idle", 50, period="day")
    ledger.calls.reserve("daily", "d1", 100)
    ledger.calls.mark_sending("d1")
    ledger.calls.settle("d1", 80)
    clock.advance(minutes=5)
    ledger.calls.reserve("weekly", "w1", 200)  # held on weekly and on flat, its parent
    clock.advance(minutes=5)
    ledger.calls.reserve("monthly", "m1", 30)
    ledger.freeze("monthly")
    clock.advance(days=1)  # a new day: "daily" would open with 420 carried, not yet open
    report = {r.budget: r for r in ledger.report()}
    assert sorted(report) == ["daily", "flat", "idle", "monthly", "weekly"]
    for name, row in report.items():
        bal = ledger.balance(name)
        assert (row.cap, row.spent, row.held, row.available, row.period_start) == (
            bal.cap,
            bal.spent,
            bal.held,
            bal.available,
            bal.period_start,
        ), name
        ages = [h.age for h in ledger.holds() if h.budget == name]
        assert row.oldest_hold == (max(ages) if ages else None), name
    assert (report["daily"].cap, report["daily"].spent) == (900, 0)  # 500 + 420, at the ceiling
    assert report["weekly"].oldest_hold == timedelta(days=1, minutes=5)
    assert report["monthly"].frozen and not report["flat"].frozen
    assert (report["flat"].held, report["flat"].oldest_hold) == (200, None)
    assert len(ledger.report()) == 5 and ledger.audit() == []


def test_a_cap_change_moves_the_current_period_and_is_journaled(
    ledger: Ledger, clock: ManualClock
) -> None:
    from sqlalchemy import text

    from budget_tasks import CapBelowCommitted

    ledger.create_budget("daily", 1_000, period="day", renewal="rollover", rollover_ceiling=5_000)
    ledger.calls.reserve("daily", "d1", 300)
    ledger.calls.mark_sending("d1")
    ledger.calls.settle("d1", 300)
    clock.advance(days=1)
    assert ledger.upkeep.open_period("daily").cap == 1_700  # 700 carried
    ledger.calls.reserve("daily", "d2", 1_000)  # committed in the current period
    assert ledger.set_cap("daily", 1_500).cap == 1_500  # raised: the carry stays
    assert ledger.balance("daily").cap == 2_200
    # lowered until the period's cap equals what it has committed (the boundary): allowed
    assert ledger.set_cap("daily", 300).cap == 300
    bal = ledger.balance("daily")
    assert (bal.cap, bal.held, bal.available) == (1_000, 1_000, 0)
    with pytest.raises(CapBelowCommitted) as info:
        ledger.set_cap("daily", 299)  # one below
    assert (info.value.budget, info.value.requested, info.value.committed) == ("daily", 299, 1_000)
    assert (ledger.budget("daily").cap, ledger.balance("daily").cap) == (300, 1_000)  # unchanged
    with pytest.raises(ValueError, match="ceiling"):
        ledger.set_cap("daily", 5_001)
    for bad in (-1, 1.5, True):
        with pytest.raises((TypeError, ValueError)):
            ledger.set_cap("daily", bad)  # type: ignore[arg-type]
    with pytest.raises(UnknownBudget):
        ledger.set_cap("nope", 10)
    with ledger.engine.connect() as conn:
        entries = conn.execute(
            text("SELECT kind, cap_delta, held_delta, spent_delta, attempt_id FROM journal "
                 "WHERE kind = 'cap' ORDER BY id")
        ).all()  # fmt: skip
    assert [tuple(e) for e in entries] == [("cap", 500, 0, 0, None), ("cap", -1_200, 0, 0, None)]
    clock.advance(days=1)
    assert ledger.upkeep.open_period("daily").cap == 300  # the next period opens at the new cap
    assert ledger.audit() == []


def test_the_journal_refuses_truncate(pg_ledger: Ledger) -> None:
    from sqlalchemy import text

    pg_ledger.create_budget("t", 10)
    pg_ledger.calls.reserve("t", "k", 5)
    with pytest.raises(Exception, match="append-only"), pg_ledger.engine.begin() as conn:
        conn.execute(text("TRUNCATE journal CASCADE"))
    assert pg_ledger.audit() == []


def test_the_overrun_counter_counts_every_settler_and_is_audited(ledger: Ledger) -> None:
    """An overrun settled by a task, by reconciliation or by an operator lands in the
    period's overrun counter (what the metrics read), derived from the journal."""
    from prometheus_client import generate_latest
    from sqlalchemy import text

    from budget_tasks.metrics import registry_for

    ledger.create_budget("team", 100_000)
    for key, reserved, actual, by in (
        ("task", 100, 130, None),
        ("beat", 100, 90, "reconcile"),
        ("operator", 100, 175, "operator"),
    ):
        ledger.calls.reserve("team", key, reserved)
        ledger.calls.mark_sending(key)
        if by is None:
            ledger.calls.settle(key, actual)
        else:
            ledger.calls.mark_unknown(key, "worker lost")
            ledger.resolve_attempt(key, actual, note="checked", by=by)
    [row] = ledger.report()
    assert row.overrun == 30 + 75  # the one below its reservation adds nothing
    scraped = generate_latest(registry_for(ledger)).decode()
    assert 'budget_tasks_overrun{budget="team"} 105.0' in scraped
    assert ledger.audit() == []
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE budget_periods SET overrun = overrun + 1"))
    assert [(f.counter, f.recorded, f.journal) for f in ledger.audit()] == [("overrun", 106, 105)]
