"""Failure 9: a rollover never carries money the old period can still spend.

A day budget of 1,000 that rolls its unused amount over allows 2,000 of admissions
over two days when the first day spends nothing. Hosts whose clocks disagree at
midnight, reservations in flight at the boundary, a late correction to the old day
and a read of tomorrow's balance must all keep it at 2,000: a period closes (admits
nothing more) before it carries, reads open nothing, and the ledger keeps time by the
database's clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from budget_tasks import BudgetExceeded, Ledger
from budget_tasks.testing import ManualClock
from tests.support import race

MIDNIGHT = datetime(2026, 3, 2, tzinfo=UTC)
ALLOWANCE = 1_000


@pytest.fixture
def url(pg_url: str, pg_ledger: Ledger) -> str:
    pg_ledger.create_budget(
        "daily", ALLOWANCE, period="day", renewal="rollover", rollover_ceiling=3 * ALLOWANCE
    )
    return pg_url


def host(url: str, at: datetime) -> Ledger:
    return Ledger(url, clock=ManualClock(at))


def admit_all(ledger: Ledger, tag: str, each: int = 100) -> int:
    """Reserve ``each`` until refused; what was admitted."""
    admitted = 0
    for n in range(10_000):
        try:
            ledger.calls.reserve("daily", f"{tag}-{n}", each)
        except BudgetExceeded:
            return admitted
        admitted += each
    raise AssertionError("never refused")


def periods(url: str) -> list[tuple[datetime, int, int, int, int, bool]]:
    ledger = Ledger(url)
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT period_start, cap, spent, held, carried_out, closed_at IS NOT NULL "
                "FROM budget_periods ORDER BY period_start"
            )
        ).all()
    ledger.dispose()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def test_a_host_whose_clock_is_behind_at_midnight_cannot_spend_what_was_carried(
    url: str,
) -> None:
    day1 = host(url, MIDNIGHT - timedelta(hours=1))
    day1.upkeep.open_period("daily")  # day 1 is open and nothing is spent in it
    fast = host(url, MIDNIGHT + timedelta(seconds=1))
    slow = host(url, MIDNIGHT - timedelta(seconds=1))  # two seconds behind
    assert fast.upkeep.open_period("daily").cap == 2 * ALLOWANCE  # day 1's 1,000 carried
    # The slow host still thinks it is day 1: its reservations go to day 2.
    admitted = admit_all(slow, "slow") + admit_all(fast, "fast")
    assert admitted == 2 * ALLOWANCE
    assert [a.period_start for a in slow.attempts()] == [MIDNIGHT] * 20
    (d1, cap1, spent1, held1, carried, closed1), (d2, cap2, *_rest, closed2) = periods(url)
    assert (d1, cap1, spent1 + held1, carried, closed1) == (
        MIDNIGHT - timedelta(days=1),
        ALLOWANCE,
        0,
        ALLOWANCE,
        True,
    )
    assert (d2, cap2, closed2) == (MIDNIGHT, 2 * ALLOWANCE, False)
    for ledger in (day1, fast, slow):
        assert ledger.audit() == []
        ledger.dispose()


def test_a_host_that_knew_the_old_day_open_admits_nothing_into_it_once_closed(
    url: str,
) -> None:
    """The slow host reserved in day 1 (it keeps that period's id), then another host
    opened day 2, which closed day 1 and carried what it left. The slow host, its clock
    still on day 1, admits its next reservation into day 2: the admission itself
    refuses a closed period, whatever the host remembers."""
    slow = host(url, MIDNIGHT - timedelta(seconds=1))
    slow.calls.reserve("daily", "slow-before", 100)  # day 1, its period now known to the host
    fast = host(url, MIDNIGHT + timedelta(seconds=1))
    assert fast.upkeep.open_period("daily").cap == 2 * ALLOWANCE - 100  # day 1's 900 carried
    after = slow.calls.reserve("daily", "slow-after", 100)
    assert after.period_start == MIDNIGHT
    (d1, _, spent1, held1, carried, closed1), (d2, cap2, _, held2, _, closed2) = periods(url)
    assert (d1, spent1 + held1, carried, closed1) == (MIDNIGHT - timedelta(days=1), 100, 900, True)
    assert (d2, cap2, held2, closed2) == (MIDNIGHT, 2 * ALLOWANCE - 100, 100, False)
    assert admit_all(fast, "fast") == 2 * ALLOWANCE - 200  # never more than was left
    for ledger in (slow, fast):
        assert ledger.audit() == []
        ledger.dispose()


def _reserve_at(url: str, at: datetime, tag: str, count: int) -> int:
    """Reserve 50 ``count`` times on a host whose clock says ``at`` (0: open the
    period instead); what was admitted."""
    ledger = Ledger(url, clock=ManualClock(at))
    if count == 0:
        ledger.upkeep.open_period("daily")
    admitted = 0
    for n in range(count):
        try:
            ledger.calls.reserve("daily", f"{tag}-{n}", 50)
            admitted += 50
        except BudgetExceeded:
            pass
    ledger.dispose()
    return admitted


def test_reservations_in_flight_at_the_boundary_are_counted_once(url: str) -> None:
    """Processes with day 1 clocks reserve while another opens day 2: what day 1
    admitted before it closed is not carried; nothing is admitted into it after."""
    host(url, MIDNIGHT - timedelta(hours=1)).upkeep.open_period("daily")
    before = MIDNIGHT - timedelta(milliseconds=100)
    after = MIDNIGHT + timedelta(milliseconds=100)
    results = race(
        _reserve_at,
        [*((url, before, f"late{i}", 30) for i in range(4)), (url, after, "opener", 0)],
    )
    (_, cap1, spent1, held1, carried, closed1), (_, cap2, _, held2, _, closed2) = periods(url)
    assert closed1 and not closed2
    assert carried == cap1 - spent1 - held1  # exactly what day 1 left unused when it closed
    assert cap2 == ALLOWANCE + carried
    assert sum(results) == held1 + held2  # every admission landed in one day or the other
    assert held1 + cap2 == 2 * ALLOWANCE  # and the two days admit 2,000 at most
    assert held2 <= cap2


def test_a_late_correction_to_the_old_day_comes_off_what_it_carried(url: str) -> None:
    day1 = host(url, MIDNIGHT - timedelta(hours=1))
    day1.calls.reserve("daily", "early", 500)
    day1.calls.mark_sending("early")
    day1.calls.settle("early", 500)
    day2 = host(url, MIDNIGHT + timedelta(hours=1))
    assert day2.upkeep.open_period("daily").cap == 1_500  # 500 unused, carried
    # The provider corrects day 1's call upwards by 300: day 1 spent 800, so it only
    # had 200 to carry; the other 300 comes off day 2.
    assert day1.adjust("early", 300, "invoice correction", ref="inv-1")
    assert day2.balance("daily").cap == 1_200
    admitted = admit_all(day2, "d2")
    assert 800 + admitted == 2 * ALLOWANCE
    for ledger in (day1, day2):
        assert ledger.audit() == []
        ledger.dispose()


def test_an_overrun_settled_after_midnight_comes_off_what_was_carried(url: str) -> None:
    day1 = host(url, MIDNIGHT - timedelta(hours=1))
    day1.calls.reserve("daily", "slow-call", 400)
    day1.calls.mark_sending("slow-call")
    day2 = host(url, MIDNIGHT + timedelta(hours=1))
    assert day2.upkeep.open_period("daily").cap == 1_600  # 600 unused (the hold is not carried)
    day1.calls.settle("slow-call", 700)  # the call cost more than its estimate
    # Day 1: spent 700 of 1,000, so only 300 was truly unused: 300 comes off day 2.
    assert day2.balance("daily").cap == 1_300
    assert 700 + admit_all(day2, "d2") == 2 * ALLOWANCE
    for ledger in (day1, day2):
        assert ledger.audit() == []
        ledger.dispose()


def test_an_overrun_settled_two_days_late_comes_off_every_carry_it_passed_through(
    url: str,
) -> None:
    """Day 1 carries into day 2, day 2 (spending nothing) carries into day 3; then day
    1's call settles above its hold. What day 1 carried too much, day 2 carried on too:
    it comes off day 3 as well, so three days admit three allowances, no more."""
    day1 = host(url, MIDNIGHT - timedelta(hours=1))
    day1.calls.reserve("daily", "slow-call", 500)
    day1.calls.mark_sending("slow-call")
    day2 = host(url, MIDNIGHT + timedelta(hours=1))
    assert day2.upkeep.open_period("daily").cap == 1_500
    day3 = host(url, MIDNIGHT + timedelta(days=1, hours=1))
    assert day3.upkeep.open_period("daily").cap == 2_500  # day 2 carried all 1,500
    day1.calls.settle("slow-call", 1_000)  # day 1 had nothing to carry after all
    assert day3.balance("daily").cap == 2_000
    assert 1_000 + admit_all(day3, "d3") == 3 * ALLOWANCE
    for ledger in (day1, day2, day3):
        assert ledger.audit() == []
        ledger.dispose()


def test_reading_tomorrows_balance_opens_nothing(url: str) -> None:
    today = host(url, MIDNIGHT - timedelta(hours=1))
    today.upkeep.open_period("daily")
    tomorrow = today.balance("daily", at=MIDNIGHT + timedelta(hours=1))
    assert (tomorrow.cap, tomorrow.period_start) == (2 * ALLOWANCE, MIDNIGHT)  # would open so
    assert len(periods(url)) == 1  # but nothing opened, nothing closed
    assert admit_all(today, "today") == ALLOWANCE  # today still admits its allowance
    later = host(url, MIDNIGHT + timedelta(hours=1))
    assert later.upkeep.open_period("daily").cap == ALLOWANCE  # nothing left to carry
    assert admit_all(later, "tomorrow") == ALLOWANCE
    today.dispose()
    later.dispose()


def test_the_ledger_keeps_time_by_the_database(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose clock is a day behind still reserves in the database's today."""
    import budget_tasks.ledger.store as core

    real_now = core._utcnow
    monkeypatch.setattr(core, "_utcnow", lambda: real_now() - timedelta(days=1))
    ledger = Ledger(url)  # no clock given: the database's
    with ledger.engine.connect() as conn:
        theirs = conn.execute(text("SELECT now()")).scalar_one()
    assert abs(ledger.now() - theirs) < timedelta(seconds=5)
    reservation = ledger.calls.reserve("daily", "today", 10)
    assert reservation.period_start.date() == theirs.astimezone(UTC).date()
    ledger.dispose()
