"""Budget periods: where a period starts, and what cap a new period opens with.

All period boundaries are UTC. A budget with period ``none`` has one period that
starts at the epoch and never ends.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal

Period = Literal["none", "day", "week", "month"]
Renewal = Literal["reset", "rollover"]

PERIODS: tuple[Period, ...] = ("none", "day", "week", "month")
RENEWALS: tuple[Renewal, ...] = ("reset", "rollover")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Default rollover ceiling, as a multiple of the period's allowance.
DEFAULT_ROLLOVER_MULTIPLE = 3


def period_start(period: Period, at: datetime) -> datetime:
    """The start of the period of kind ``period`` that contains ``at``."""
    at = at.astimezone(UTC)
    midnight = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "none":
        return EPOCH
    if period == "day":
        return midnight
    if period == "week":
        return midnight - timedelta(days=midnight.weekday())
    if period == "month":
        return midnight.replace(day=1)
    raise ValueError(f"unknown period {period!r}")


def previous_period_start(period: Period, start: datetime) -> datetime | None:
    """The start of the period before the one starting at ``start`` (None for ``none``)."""
    if period == "none":
        return None
    return period_start(period, start - timedelta(microseconds=1))


def next_period_start(period: Period, start: datetime) -> datetime | None:
    """The start of the period after the one starting at ``start`` (None for ``none``)."""
    if period == "none":
        return None
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    if start.month == 12:
        return start.replace(year=start.year + 1, month=1)
    return start.replace(month=start.month + 1)


def opening_cap(
    allowance: int,
    renewal: Renewal,
    ceiling: int | None,
    previous: tuple[int, int, int] | None,
) -> int:
    """The cap a new period opens with, by the budget's written renewal policy.

    ``reset``: the allowance. ``rollover``: the allowance plus what the immediately
    preceding period left unused (cap - spent - held as it stood when this period
    opened; holds still open are not carried), the total capped at ``ceiling``
    (default 3x the allowance). A preceding period that never opened carries nothing.
    """
    if renewal == "reset" or previous is None:
        return allowance
    prev_cap, prev_spent, prev_held = previous
    unused = max(0, prev_cap - prev_spent - prev_held)
    limit = ceiling if ceiling is not None else DEFAULT_ROLLOVER_MULTIPLE * allowance
    return max(allowance, min(limit, allowance + unused))


class PeriodClosed(Exception):
    """Internal: admission met a closed period, so a later one is open (this host's
    clock is behind): the caller forgets its cached periods and admits again."""
