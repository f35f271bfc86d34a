"""Where the ledger's features meet: each behaviour here lost or locked up money when
two features were used together (issue 41), and each test fails on the code before its
fix. Every test runs on each execution path the ledger has: PostgreSQL with its
server-side functions, PostgreSQL statement by statement, and SQLite (retention and
partitions are PostgreSQL's only)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from budget_tasks import BudgetExceeded, Ledger, RetentionRefused
from budget_tasks.errors import BudgetExists, CapBelowCommitted, UnknownBudget
from budget_tasks.testing import ManualClock

from ..conftest import empty_ledger_tables

#: A Tuesday: the week (from Monday 30 November) began in the month before.
DEC_1 = datetime(2026, 12, 1, 12, tzinfo=UTC)

PATHS = ("pg-functions", "pg-statements", "sqlite")


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(DEC_1)


def open_ledger(path: str, request: pytest.FixtureRequest, clock: ManualClock) -> Ledger:
    if path == "sqlite":
        url = str(request.getfixturevalue("sqlite_url"))
        return Ledger(url, clock=clock)
    url = str(request.getfixturevalue("pg_url"))
    empty_ledger_tables(url)
    return Ledger(url, clock=clock, server_functions=path == "pg-functions")


@pytest.fixture
def ledger(path: str, request: pytest.FixtureRequest, clock: ManualClock) -> Iterator[Ledger]:
    ledger = open_ledger(path, request, clock)
    yield ledger
    ledger.dispose()


@pytest.fixture
def nov_clock() -> ManualClock:
    return ManualClock(datetime(2026, 11, 20, tzinfo=UTC))


@pytest.fixture(params=PATHS[:2])
def pg(request: pytest.FixtureRequest, nov_clock: ManualClock) -> Iterator[Ledger]:
    """A PostgreSQL ledger (retention and partitions) on each of its paths, from 20
    November."""
    ledger = open_ledger(str(request.param), request, nov_clock)
    yield ledger
    ledger.dispose()


def view(ledger: Ledger, name: str) -> tuple[int, int, int, int]:
    """(cap, spent, held, available) as ``balance`` and as ``report`` show it: the two
    must agree."""
    bal = ledger.balance(name)
    [row] = [r for r in ledger.report() if r.budget == name]
    shown = (bal.cap, bal.spent, bal.held, bal.available)
    assert (row.cap, row.spent, row.held, row.available) == shown, (name, row, bal)
    return shown


def charge(ledger: Ledger, budget: str, key: str, amount: int, actual: int) -> None:
    ledger.calls.reserve(budget, key, amount)
    ledger.calls.mark_sending(key)
    ledger.calls.settle(key, actual)


def period_figures(ledger: Ledger, name: str, day: str) -> tuple[int, int]:
    """(spent, held) of ``name``'s period that began on ``day`` (UTC), open or closed,
    as its own row has them."""
    with ledger.engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT p.spent, p.held FROM budget_periods p JOIN budgets b ON b.id = p.budget_id"
                " WHERE b.name = :name AND p.period_start = :start"
            ),
            {"name": name, "start": f"{day}T00:00:00+00:00"},
        ).one()
    return int(row[0]), int(row[1])


def spent_and_held_on_slices(ledger: Ledger, name: str) -> None:
    """A budget of 1,000 in 4 slices that has spent 300 and holds 300."""
    ledger.create_budget(name, 1_000, slices=4)
    for i in range(6):
        ledger.calls.reserve(name, f"k{i}", 100)
    for i in range(3):
        ledger.calls.mark_sending(f"k{i}")
        ledger.calls.settle(f"k{i}", 100)


# -- retention with parents -----------------------------------------------------------


def test_retention_keeps_a_month_whose_parent_periods_hold_a_later_attempts_money(
    pg: Ledger, nov_clock: ManualClock, tmp_path: Path
) -> None:
    """A day tenant under a week parent: an attempt admitted on Tuesday 1 December holds
    money on its parent's week, which began on Monday 30 November, in November's
    partition. While it is unknown, November stays; resolved, its charge reaches the
    parent; then November leaves and every view and the full audit agree."""
    pg.upkeep.make_partitions(ahead=3)
    nov_clock.advance(DEC_1 - nov_clock())
    pg.create_budget("org", 1_000, period="week")
    pg.create_budget("team", 1_000, period="day", parent="org")
    for key in ("u1", "u2"):
        pg.calls.reserve("team", key, 50)
        pg.calls.mark_sending(key)
        pg.calls.mark_unknown(key, "timed out")
    nov_clock.advance(days=50)  # 20 January
    for name in ("org", "team"):
        pg.upkeep.open_period(name)  # every earlier period closes
    done = pg.upkeep.retain(timedelta(days=30), archive_to=tmp_path)
    assert "journal_y2026m11" not in done.archived
    assert any("holding money" in why for why in done.blocked["journal_y2026m11"])
    for key in ("u1", "u2"):
        pg.resolve_attempt(key, 80, note="the provider bill", by="operator")
    assert period_figures(pg, "org", "2026-11-30") == (160, 0)
    done = pg.upkeep.retain(timedelta(days=30), archive_to=tmp_path)
    assert "journal_y2026m11" in done.archived
    assert pg.audit() == [] and pg.audit(full=True) == []


def test_a_month_its_parent_closed_for_an_escrowed_tenant_leaves_and_still_carries(
    pg: Ledger, nov_clock: ManualClock, tmp_path: Path
) -> None:
    """Found by the model test's long run: a parent's next month closes its escrowed
    tenant's month, so retention may archive that month before the tenant opens its
    next; the tenant's next month still carries what the archived one left."""
    pg.upkeep.make_partitions(ahead=3)
    pg.create_budget("org", 1_000, period="month")
    pg.create_budget("team", 100, period="month", parent="org", escrow=True, renewal="rollover")
    charge(pg, "team", "nov", 40, 40)  # 60 left unused in November
    nov_clock.advance(days=12)  # 2 December
    pg.upkeep.open_period("org")  # closes org's November and team's
    done = pg.upkeep.retain(timedelta(days=1), archive_to=tmp_path)
    assert "journal_y2026m11" in done.archived, done
    assert view(pg, "team") == (160, 0, 0, 160)  # a preview: 100 + 60
    pg.calls.reserve("team", "dec", 160)  # exactly what is there: admitted
    assert view(pg, "team") == (160, 0, 160, 0)
    assert pg.audit() == [] and pg.audit(full=True) == []


def test_a_correction_of_an_attempt_whose_parents_month_left_is_refused_not_halved(
    pg: Ledger, nov_clock: ManualClock, tmp_path: Path
) -> None:
    """Found by the model test: a day tenant's attempt of Tuesday 1 December holds in
    its parent's week of 30 November too. Once November is archived, the attempt stays
    (its own period is December's), and a provider's correction was written to the
    tenant's day alone: the parent's week never saw it. It is refused, typed."""
    pg.upkeep.make_partitions(ahead=3)
    nov_clock.advance(DEC_1 - nov_clock())
    pg.create_budget("org", 1_000, period="week")
    pg.create_budget("team", 1_000, period="day", parent="org")
    charge(pg, "team", "k", 50, 50)
    nov_clock.advance(days=40)  # 10 January: November ended over 35 days ago, December not
    for name in ("org", "team"):
        pg.upkeep.open_period(name)
    done = pg.upkeep.retain(timedelta(days=35), archive_to=tmp_path)
    assert done.archived == ("journal_y2026m11",), done
    assert pg.attempt("k").state == "settled"  # its own period is December's: it stays
    with pytest.raises(RetentionRefused, match="2026-11"):
        pg.adjust("k", 5, "a late invoice line", ref="inv-1")
    assert period_figures(pg, "team", "2026-12-01") == (50, 0)  # nothing was written
    assert pg.audit() == [] and pg.audit(full=True) == []


def test_an_escrowed_tenants_open_hold_keeps_the_month_its_parents_period_began_in(
    pg: Ledger, nov_clock: ManualClock, tmp_path: Path
) -> None:
    """Found by the model test's 100,000-step run: an escrowed day tenant's hold is
    journalled in its own December day only, but a late overrun draws the rest from its
    parent's week of 30 November. Retention archived November while the hold was still
    unknown; the settlement then had nowhere to write. November now waits for it."""
    pg.upkeep.make_partitions(ahead=3)
    nov_clock.advance(datetime(2026, 12, 5, 12, tzinfo=UTC) - nov_clock())  # a Saturday
    pg.create_budget("org", 1_000, period="week")
    pg.create_budget("team", 1_000, period="day", parent="org", escrow=True)
    pg.calls.reserve("team", "k", 10)
    pg.calls.mark_sending("k")
    pg.calls.mark_unknown("k", "timed out")
    nov_clock.advance(days=40)  # 14 January
    for name in ("org", "team"):
        pg.upkeep.open_period(name)  # every earlier period closes
    done = pg.upkeep.retain(timedelta(days=35), archive_to=tmp_path)
    assert "journal_y2026m11" not in done.archived, done
    assert any("holding money" in why for why in done.blocked["journal_y2026m11"])
    pg.resolve_attempt("k", 80, note="the provider bill", by="operator")  # past its grant
    assert period_figures(pg, "team", "2026-12-05") == (80, 0)
    done = pg.upkeep.retain(timedelta(days=35), archive_to=tmp_path)
    assert "journal_y2026m11" in done.archived, done
    assert pg.audit() == [] and pg.audit(full=True) == []


# -- escrow with rollover ----------------------------------------------------------------


@pytest.mark.parametrize("first", ["parent", "sibling", "beat by name"])
def test_an_escrowed_tenant_carries_whoever_opens_its_parents_period_first(
    ledger: Ledger, clock: ManualClock, first: str
) -> None:
    """A tenant (escrowed, rollover) that left 90 unused on day 1 opens day 2 at 190,
    whether it opens its own day first or its parent's day opens first (a sibling's
    call, or beat's renewal, which goes by budget name)."""
    # the parent's name sorts first: beat's renewal opens its day before its tenants'
    ledger.create_budget("acme", 10_000, period="day")
    ledger.create_budget("tenant-a", 100, period="day", parent="acme", escrow=True,
                         renewal="rollover")  # fmt: skip
    ledger.create_budget("tenant-b", 100, period="day", parent="acme", escrow=True)
    charge(ledger, "tenant-a", "d1", 10, 10)
    clock.advance(days=1)
    if first == "parent":
        ledger.upkeep.open_period("acme")
    elif first == "sibling":
        charge(ledger, "tenant-b", "d2-b", 5, 5)
    else:
        for name in sorted(b.name for b in ledger.budgets()):
            ledger.upkeep.open_period(name)
    assert view(ledger, "tenant-a")[0] == 190
    charge(ledger, "tenant-a", "d2", 150, 150)  # more than the allowance: the carry
    assert view(ledger, "tenant-a") == (190, 150, 0, 40)
    assert ledger.audit(full=True) == []


# -- slices under escrow -------------------------------------------------------------------


def test_a_sliced_tenants_idle_grants_never_refuse_its_sibling_or_its_parent(
    ledger: Ledger,
) -> None:
    """Four calls of 10 on tenant ``a`` (escrowed, 4 slices) draw grants down the tree;
    released, nothing is spent or held, so 900 fits on ``b`` and on the parent: what
    ``a``'s slices hold unused is taken back, however deep."""
    ledger.create_budget("org", 1_000)
    ledger.create_budget("a", 1_000, parent="org", escrow=True, slices=4)
    ledger.create_budget("b", 1_000, parent="org", escrow=True)
    for i in range(4):
        ledger.calls.reserve("a", f"a{i}", 10)
        ledger.calls.release(f"a{i}", "not sent")
    ledger.calls.reserve("b", "b-big", 900)
    ledger.calls.release("b-big", "not sent")
    ledger.calls.reserve("org", "org-big", 900)
    ledger.calls.reserve("org", "org-rest", 100)  # exactly what is left
    with pytest.raises(BudgetExceeded):
        ledger.calls.reserve("org", "org-one-more", 1)
    assert ledger.audit(full=True) == []


# -- cap changes ---------------------------------------------------------------------------


def test_a_cap_below_what_slices_spent_and_hold_is_refused(ledger: Ledger) -> None:
    spent_and_held_on_slices(ledger, "hot")
    with pytest.raises(CapBelowCommitted) as refused:
        ledger.set_cap("hot", 200)
    assert refused.value.committed == 600
    assert view(ledger, "hot") == (1_000, 300, 300, 400)
    ledger.set_cap("hot", 600)  # exactly what is committed
    assert view(ledger, "hot") == (600, 300, 300, 0)
    assert ledger.audit(full=True) == []


def test_a_parents_cap_below_what_its_tenant_spent_and_holds_is_refused(ledger: Ledger) -> None:
    ledger.create_budget("org", 1_000)
    ledger.create_budget("t", 1_000, parent="org", escrow=True)
    charge(ledger, "t", "spent", 300, 300)
    ledger.calls.reserve("t", "held", 300)
    with pytest.raises(CapBelowCommitted) as refused:
        ledger.set_cap("org", 100)
    assert refused.value.committed == 600
    ledger.set_cap("org", 600)  # the tenant's unused grant was not committed
    with pytest.raises(BudgetExceeded):
        ledger.calls.reserve("t", "over", 1)
    assert ledger.balance("org").available == 0
    assert ledger.audit(full=True) == []


# -- two views -----------------------------------------------------------------------------


def test_balance_and_report_agree_after_a_budget_goes_back_to_one_slice(ledger: Ledger) -> None:
    spent_and_held_on_slices(ledger, "hot")
    ledger.set_slices("hot", 1)
    assert view(ledger, "hot") == (1_000, 300, 300, 400)
    ledger.calls.reserve("hot", "rest", 400)
    with pytest.raises(BudgetExceeded):
        ledger.calls.reserve("hot", "more", 1)


# -- a half-made budget --------------------------------------------------------------------


def test_a_refused_slicing_leaves_no_budget_behind(ledger: Ledger) -> None:
    long = "n" * 200
    with pytest.raises(ValueError, match="too long to slice"):
        ledger.create_budget(long, 1_000, slices=4)
    with pytest.raises(UnknownBudget):
        ledger.budget(long)
    ledger.create_budget(long, 1_000)  # the retry without slices is a new budget
    ledger.create_budget("daily", 1_000, period="day")
    with pytest.raises(ValueError, match="cannot draw grants"):
        ledger.create_budget("weekly", 1_000, period="week", parent="daily", slices=2)
    with pytest.raises(UnknownBudget):
        ledger.budget("weekly")
    ledger.create_budget("weekly", 1_000, period="week", parent="daily")
    with pytest.raises(BudgetExists):
        ledger.create_budget("weekly", 1_000, period="week", parent="daily")
    assert sorted(b.name for b in ledger.budgets()) == ["daily", long, "weekly"]


# -- a parent's figures ------------------------------------------------------------------


def test_a_parents_figures_include_its_tenants_and_their_slices_in_every_view(
    ledger: Ledger, clock: ManualClock
) -> None:
    """A month parent with a day tenant in two slices (escrowed), a day tenant without
    escrow and a day tenant with escrow under that one: what each spent and holds is
    the parent's too, across the tenants' days, in balance and report alike; what
    their grants hold unused is available; a late settlement below its hold in a closed
    day gives its grant back at once."""
    ledger.create_budget("org", 1_000, period="month")
    ledger.create_budget("sliced", 1_000, period="day", parent="org", escrow=True, slices=2)
    ledger.create_budget("plain", 1_000, period="day", parent="org")
    ledger.create_budget("deep", 1_000, period="day", parent="plain", escrow=True)
    charge(ledger, "sliced", "s1", 100, 90)
    charge(ledger, "plain", "p1", 50, 50)
    charge(ledger, "deep", "d1", 30, 20)
    ledger.calls.reserve("deep", "late", 40)
    ledger.calls.mark_sending("late")
    ledger.calls.mark_unknown("late", "timed out")
    ledger.calls.reserve("sliced", "slow", 30)
    ledger.calls.mark_sending("slow")  # still out at midnight
    assert view(ledger, "org") == (1_000, 160, 70, 770)
    assert view(ledger, "plain") == (1_000, 70, 40, 890)
    assert view(ledger, "sliced") == (1_000, 90, 30, 880)
    clock.advance(days=1)
    for name in ("org", "plain", "deep", "sliced"):
        ledger.upkeep.open_period(name)  # yesterday's days close: grants come back
    charge(ledger, "sliced", "s2", 10, 10)
    assert view(ledger, "org") == (1_000, 170, 70, 760)
    # a run's late settlement below its hold (on PostgreSQL, the settlement function's
    # call) and an operator's resolution: each closed day gives back what it freed
    ledger.calls.settle("slow", 12)
    assert view(ledger, "org") == (1_000, 182, 40, 778)
    ledger.resolve_attempt("late", 25, note="the provider bill", by="operator")
    assert view(ledger, "org") == (1_000, 207, 0, 793)
    assert view(ledger, "plain")[1:3] == (0, 0)  # its own new day
    ledger.calls.reserve("org", "rest", 793)  # exactly what is left, unused grants too
    with pytest.raises(BudgetExceeded):
        ledger.calls.reserve("sliced", "one-more", 1)
    assert ledger.audit(full=True) == []


def test_an_escrowed_budget_takes_back_its_own_tenants_unused_grants_before_it_refuses(
    ledger: Ledger,
) -> None:
    """Found by the model test: ``mid`` (escrowed under ``top``) has an escrowed
    tenant in 3 slices; a call of 100 on the tenant, released, leaves ``mid``'s whole
    cap granted below and unused. A call of 60 on ``mid`` itself fits, and is admitted."""
    ledger.create_budget("top", 250, period="week")
    ledger.create_budget("mid", 100, period="week", parent="top", escrow=True)
    ledger.create_budget("low", 100, period="week", parent="mid", escrow=True, slices=3)
    ledger.calls.reserve("low", "big", 100)
    ledger.calls.release("big", "not sent")
    assert view(ledger, "mid") == (100, 0, 0, 100)
    ledger.calls.reserve("mid", "fits", 60)
    ledger.calls.reserve("low", "rest", 40)  # exactly what is left
    with pytest.raises(BudgetExceeded):
        ledger.calls.reserve("low", "more", 1)
    assert view(ledger, "mid") == (100, 0, 100, 0)
    assert ledger.audit(full=True) == []


def test_a_parent_carries_what_its_tenants_slices_held_unused(
    ledger: Ledger, clock: ManualClock
) -> None:
    """A rollover parent whose escrowed tenant is sliced: the slices' unused grants are
    drawn from the parent too. When the parent's next day opens first, they come back
    before it carries, so it carries all it left unused."""
    ledger.create_budget("org", 100, period="day", renewal="rollover")
    ledger.create_budget("tenant", 100, period="day", parent="org", escrow=True, slices=2)
    for i in range(3):
        ledger.calls.reserve("tenant", f"t{i}", 10)
        ledger.calls.release(f"t{i}", "not sent")
    charge(ledger, "tenant", "spent", 10, 10)
    clock.advance(days=1)
    assert view(ledger, "org") == (190, 0, 0, 190)  # what it would open with: a read
    ledger.upkeep.open_period("org")
    assert view(ledger, "org") == (190, 0, 0, 190)
    ledger.calls.reserve("org", "all", 190)  # exactly the carry and the allowance
    assert ledger.audit(full=True) == []


@pytest.mark.parametrize(("escrow", "slices"), [(True, 1), (False, 2), (False, 1)])
def test_a_parents_overrun_includes_its_tenants_with_escrow_or_without(
    ledger: Ledger, clock: ManualClock, escrow: bool, slices: int
) -> None:
    # Found by the model test: with escrow (or slices, which are escrowed) the tenant's
    # charge is journalled in the tenant's period only, so the parent's own overrun
    # counter never sees it. Without either, a run's settlement is the server
    # function's on PostgreSQL, and it counts the overrun in every period itself.
    ledger.create_budget("org", 1_000, period="day")
    ledger.create_budget("team", 500, period="day", parent="org", escrow=escrow, slices=slices)
    charge(ledger, "team", "a", 10, 200)  # 190 over its reservation
    charge(ledger, "team", "b", 50, 40)  # under: no overrun
    rows = {r.budget: r for r in ledger.report()}
    assert (rows["team"].overrun, rows["org"].overrun) == (190, 190)
    assert view(ledger, "org") == (1_000, 240, 0, 760)
    assert ledger.audit(full=True) == []  # each overrun counter equals its journal
    clock.advance(days=1)  # the next day: nothing over yet
    ledger.calls.reserve("team", "c", 1)
    assert {r.budget: r.overrun for r in ledger.report()} == {"org": 0, "team": 0}
