"""The reference model of the ledger's money rules (tests/model/ledger_model.py), on its
own: each test states one rule on a small case worked out by hand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.model.ledger_model import (
    BudgetExceeded,
    BudgetFrozen,
    CapBelowCommitted,
    InvalidTransition,
    LedgerModel,
    OperationFailed,
    SettlementConflict,
    UnknownAttempt,
)

MONDAY = datetime(2026, 3, 2, 12, tzinfo=UTC)
DAY = timedelta(days=1)


def charged(model: LedgerModel, budget: str, key: str, amount: int, actual: int) -> None:
    """Reserve, send and settle one attempt."""
    model.reserve(budget, key, amount)
    model.mark_sending(key)
    model.settle(key, actual)


def figures(model: LedgerModel, budget: str) -> tuple[int, int, int, int]:
    b = model.balance(budget)
    return b.cap, b.spent, b.held, b.available


def test_money_is_an_int_of_minor_units() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("b", 100)
    for bad, error in ((1.5, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(error):
            model.reserve("b", "k", bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        model.create_budget("c", 10.0)  # type: ignore[arg-type]
    assert model.attempts == {}


def test_exactly_what_is_left_is_admitted_and_a_refusal_changes_nothing() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("org", 100, period="day")
    model.create_budget("team", 80, period="day", parent="org")
    model.reserve("team", "a", 50)
    model.reserve("org", "b", 50)  # org: 100 - 50 held - 50 = 0 left
    assert figures(model, "org") == (100, 0, 100, 0)
    before = (model.report(), model.holds(), list(model.journal))
    with pytest.raises(BudgetExceeded) as refused:
        model.reserve("team", "c", 1)  # team has 30 left, org none
    assert refused.value.args[0] == "org"
    assert (model.report(), model.holds(), model.journal) == before
    assert model.reserve("team", "d", 0).held == 0


def test_figures_roll_up_through_escrow_and_slices() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("org", 1000, period="month")
    model.create_budget("tenant", 500, period="day", parent="org", escrow=True, slices=4)
    model.create_budget("team", 300, period="day", parent="tenant")
    charged(model, "team", "a", 100, 70)
    model.reserve("tenant", "b", 50)
    assert figures(model, "team") == (300, 70, 0, 230)
    assert figures(model, "tenant") == (500, 70, 50, 380)
    assert figures(model, "org") == (1000, 70, 50, 880)
    model.set_slices("tenant", 1)  # the former slices' money stays the budget's
    assert figures(model, "tenant") == (500, 70, 50, 380)
    # the next day, tenant and team start afresh; org's month still counts them
    model.advance(MONDAY + DAY)
    charged(model, "team", "c", 10, 10)
    assert figures(model, "tenant") == (500, 10, 0, 490)
    assert figures(model, "org") == (1000, 80, 50, 870)
    assert model.audit() == []


def test_escrow_and_slices_must_nest_in_their_ancestors_periods() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("org", 1000, period="month")
    with pytest.raises(ValueError, match="nest"):
        model.create_budget("weekly", 100, period="week", parent="org", escrow=True)
    model.create_budget("weekly", 100, period="week", parent="org")  # without escrow
    with pytest.raises(ValueError, match="nest"):
        model.set_slices("weekly", 2)


def two_day_tree(model: LedgerModel) -> None:
    """org (day, rollover 1000) over tenant (escrowed, day, rollover 300); on day 1
    tenant spends 100 and holds 50, org spends 200 more."""
    model.create_budget("org", 1000, period="day", renewal="rollover")
    model.create_budget("tenant", 300, period="day", parent="org", renewal="rollover", escrow=True)
    charged(model, "tenant", "a", 100, 100)
    model.reserve("tenant", "open", 50)
    charged(model, "org", "b", 200, 200)
    model.advance(MONDAY + DAY)


@pytest.mark.parametrize("order", [["org", "tenant"], ["tenant", "org"]])
def test_rollover_carry_does_not_depend_on_which_budget_opens_first(order: list[str]) -> None:
    model = LedgerModel(MONDAY)
    two_day_tree(model)
    # what a read shows before anything opens is what opening gives
    assert model.balance("tenant").cap == 300 + 150
    for name in order:
        model.open_period(name)
    # open holds are not carried: tenant 300 - 100 - 50, org 1000 - 300 - 50
    assert figures(model, "tenant") == (450, 0, 0, 450)
    assert figures(model, "org") == (1650, 0, 0, 1650)


@pytest.mark.parametrize("order", [["org", "tenant"], ["tenant", "org"]])
def test_renewal_in_any_order_and_by_a_reservation_agree(order: list[str]) -> None:
    by_beat, by_call = LedgerModel(MONDAY), LedgerModel(MONDAY)
    two_day_tree(by_beat)
    two_day_tree(by_call)
    by_beat.renew_all(order)
    by_call.reserve("tenant", "c", 0)  # opens tenant's day 2, then org's
    assert by_beat.report() == by_call.report()


def test_a_late_charge_after_a_carry_comes_off_the_next_caps() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("org", 1000, period="day")
    model.create_budget("tenant", 300, period="day", parent="org", renewal="rollover", escrow=True)
    model.reserve("tenant", "a", 100)
    model.mark_sending("a")
    model.advance(MONDAY + DAY)
    model.open_period("tenant")  # day 1 left 200 unused: day 2 opens at 500
    model.advance(MONDAY + 2 * DAY)
    model.open_period("tenant")  # day 2 left 500: day 3 opens at min(900, 800)
    assert model.balance("tenant").cap == 800
    model.settle("a", 250)  # day 1 now left 50, having carried 200
    midnight = MONDAY.replace(hour=0)
    day1, day2, day3 = (model.periods[("tenant", midnight + n * DAY)] for n in range(3))
    assert (day1.carried_out, day2.cap) == (50, 350)
    assert (day2.carried_out, day3.cap) == (350, 650)
    assert figures(model, "tenant") == (650, 0, 0, 650)
    org_day1 = model.figures("org", midnight)
    assert org_day1 == (250, 0, 150)  # spent, held, overrun
    assert model.audit() == []


def test_cap_below_committed_counts_slices_and_escrowed_budgets() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("sliced", 1000, period="day", slices=4)
    model.reserve("sliced", "a", 600)
    with pytest.raises(CapBelowCommitted):
        model.set_cap("sliced", 599)
    model.set_cap("sliced", 600)
    assert figures(model, "sliced") == (600, 0, 600, 0)

    model.create_budget("org", 1000, period="day")
    model.create_budget("tenant", 1000, period="day", parent="org", escrow=True)
    charged(model, "tenant", "b", 300, 300)
    model.reserve("tenant", "c", 400)
    with pytest.raises(CapBelowCommitted):
        model.set_cap("org", 699)
    assert model.set_cap("org", 700).allowance == 700
    assert figures(model, "org") == (700, 300, 400, 0)


def test_set_cap_moves_the_current_period_and_keeps_its_carry() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("b", 100, period="day", renewal="rollover", rollover_ceiling=400)
    charged(model, "b", "a", 40, 40)
    model.advance(MONDAY + DAY)
    model.open_period("b")  # 100 + 60
    model.set_cap("b", 150)
    assert figures(model, "b") == (210, 0, 0, 210)
    with pytest.raises(ValueError, match="ceiling"):
        model.set_cap("b", 401)


def test_retention_waits_for_an_unknown_hold_on_a_parents_earlier_month_period() -> None:
    thursday = datetime(2024, 2, 1, 9, tzinfo=UTC)  # its week began Monday 29 January
    model = LedgerModel(thursday)
    model.create_budget("org", 1000, period="week")
    model.create_budget("team", 100, period="day", parent="org")
    model.reserve("team", "a", 100)
    model.mark_sending("a")
    model.mark_unknown("a")
    model.advance(datetime(2024, 3, 1, tzinfo=UTC))
    model.renew_all()  # closes org's week of 29 January and team's 1 February
    january = datetime(2024, 1, 1, tzinfo=UTC)
    assert model.retain(january) == "attempt a holds money"
    assert model.retain(datetime(2024, 3, 1, tzinfo=UTC)) == "the month has not ended"
    model.resolve("a", 80)
    before = model.report()
    assert model.retain(january) is None
    assert model.archived == {january}
    with pytest.raises(UnknownAttempt):
        model.adjust("a", 5)  # it left with January
    assert "is open" in str(model.retain(datetime(2024, 2, 1, tzinfo=UTC)))  # week of 26 Feb
    assert model.report() == before


def test_a_frozen_parent_stops_its_whole_subtree_but_not_settlements() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("org", 1000)
    model.create_budget("tenant", 500, parent="org", escrow=True)
    model.create_budget("team", 100, parent="tenant")
    model.reserve("team", "a", 60)
    model.mark_sending("a")
    model.freeze("org")
    for budget in ("org", "tenant", "team"):
        with pytest.raises(BudgetFrozen):
            model.reserve(budget, "b", 1)
    with pytest.raises(BudgetFrozen):
        model.reserve("team", "b", 10_000)  # frozen wins over exceeded
    assert model.settle("a", 70)
    model.unfreeze("org")
    model.reserve("team", "b", 30)
    assert figures(model, "org") == (1000, 70, 30, 900)


def test_settlement_is_once_and_conflicts_with_another_actual() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("b", 100)
    model.reserve("b", "a", 50)
    with pytest.raises(InvalidTransition):
        model.settle("a", 50)  # never sent: never charged
    model.mark_sending("a")
    assert model.settle("a", 40) is True
    assert model.settle("a", 40) is False
    with pytest.raises(SettlementConflict):
        model.settle("a", 41)
    with pytest.raises(SettlementConflict):
        model.release("a")
    assert figures(model, "b") == (100, 40, 0, 60)


def test_an_unknown_keeps_its_hold_until_resolved() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("b", 100, period="day")
    model.reserve("b", "a", 30)
    model.mark_sending("a")
    assert model.mark_unknown("a") is True
    assert model.mark_unknown("a") is False
    model.advance(MONDAY + 30 * DAY)
    assert [(h.key, h.state, h.amount) for h in model.holds()] == [("a", "unknown", 30)]
    assert model.resolve("a", 0) is True
    assert model.holds() == []


def test_an_overrun_and_an_adjustment_pass_the_cap_and_the_journal_agrees() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("b", 100)
    charged(model, "b", "a", 90, 120)
    assert model.adjust("a", 5, ref="inv-1") is True
    assert model.adjust("a", 5, ref="inv-1") is False
    assert figures(model, "b") == (100, 125, 0, -25)
    assert model.report()[0].overrun == 30
    assert model.audit() == []
    start = model.balance("b").period_start
    assert model.journal_sums()[("b", start)] == (0, 125, 30)


def test_a_reopened_operation_refused_for_budget_runs_once_the_budget_frees() -> None:
    model = LedgerModel(MONDAY)
    model.create_budget("b", 100)
    assert model.deliver("op", "b", 60) == "op#1"
    model.fail_operation("op")
    with pytest.raises(OperationFailed):
        model.deliver("op", "b", 60)
    model.reopen_operation("op")
    model.reserve("b", "other", 50)
    with pytest.raises(BudgetExceeded):
        model.deliver("op", "b", 60)
    op = model.operation("op")
    assert (op.status, op.next_reason) == ("pending", "manual")
    assert op.refusal is not None and op.refusal.startswith("BudgetExceeded")
    model.release("other")
    assert model.deliver("op", "b", 60) == "op#2"
    assert model.attempt("op#2").reason == "manual"
    model.finish_operation("op", 55)
    assert model.operation("op").status == "succeeded"
    assert model.deliver("op", "b", 60) is None  # a replay admits nothing
    assert figures(model, "b") == (100, 55, 0, 45)
