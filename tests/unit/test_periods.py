from datetime import UTC, datetime, timedelta, timezone

import pytest

from budget_tasks.ledger.periods import (
    EPOCH,
    next_period_start,
    opening_cap,
    period_start,
    previous_period_start,
)

AT = datetime(2026, 3, 18, 17, 45, 12, tzinfo=UTC)  # a Wednesday


@pytest.mark.parametrize(
    ("period", "start"),
    [
        ("none", EPOCH),
        ("day", datetime(2026, 3, 18, tzinfo=UTC)),
        ("week", datetime(2026, 3, 16, tzinfo=UTC)),
        ("month", datetime(2026, 3, 1, tzinfo=UTC)),
    ],
)
def test_period_start(period: str, start: datetime) -> None:
    assert period_start(period, AT) == start  # type: ignore[arg-type]


def test_period_start_is_utc_whatever_the_zone_given() -> None:
    tokyo = timezone(timedelta(hours=9))
    # 2026-03-19 02:00 in Tokyo is still the 18th in UTC.
    assert period_start("day", datetime(2026, 3, 19, 2, tzinfo=tokyo)) == datetime(
        2026, 3, 18, tzinfo=UTC
    )


@pytest.mark.parametrize("period", ["day", "week", "month"])
def test_next_and_previous_are_inverse(period: str) -> None:
    start = period_start(period, AT)  # type: ignore[arg-type]
    nxt = next_period_start(period, start)  # type: ignore[arg-type]
    assert nxt is not None and nxt > start
    assert previous_period_start(period, nxt) == start  # type: ignore[arg-type]
    assert period_start(period, nxt - timedelta(microseconds=1)) == start  # type: ignore[arg-type]


def test_month_rolls_over_the_year() -> None:
    assert next_period_start("month", datetime(2026, 12, 1, tzinfo=UTC)) == datetime(
        2027, 1, 1, tzinfo=UTC
    )
    assert next_period_start("none", EPOCH) is None
    assert previous_period_start("none", EPOCH) is None


def test_reset_opens_with_the_allowance() -> None:
    assert opening_cap(1000, "reset", None, (1000, 100, 0)) == 1000


def test_rollover_carries_unused_but_not_open_holds() -> None:
    # previous: cap 1000, spent 300, held 200 -> 500 unused is carried
    assert opening_cap(1000, "rollover", None, (1000, 300, 200)) == 1500


def test_rollover_default_ceiling_is_three_allowances() -> None:
    assert opening_cap(1000, "rollover", None, (2900, 0, 0)) == 3000


def test_rollover_explicit_ceiling() -> None:
    assert opening_cap(1000, "rollover", 1200, (1000, 0, 0)) == 1200


def test_rollover_after_overrun_never_opens_below_allowance() -> None:
    assert opening_cap(1000, "rollover", None, (1000, 1400, 0)) == 1000


def test_rollover_without_previous_period_carries_nothing() -> None:
    assert opening_cap(1000, "rollover", None, None) == 1000
