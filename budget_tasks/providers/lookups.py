"""What asking a provider, after the fact, about an attempt whose outcome is unknown can
answer: :class:`Found` (the actual charge and the result), :class:`NotFound`
(confirmed: no charge), :class:`Pending` (ask again later) or :class:`Unknowable` (the
API keeps no record: an operator must resolve the hold).

A provider's "not found" counts as NotFound only once the attempt is older than the
longest the provider could still be working on it (``settle_after``: the client timeout
plus a margin); before that it means Pending. A call sent with no finite timeout has no
such moment: "not found" never counts for it. Each vendor's lookups live in its module.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ..pricing import Usage


@dataclass(frozen=True, slots=True)
class Found:
    actual: int
    usage: Usage
    result: dict[str, Any]


@dataclass(frozen=True, slots=True)
class NotFound:
    reason: str


@dataclass(frozen=True, slots=True)
class Pending:
    reason: str


@dataclass(frozen=True, slots=True)
class Unknowable:
    reason: str


Lookup = Found | NotFound | Pending | Unknowable


def not_found(
    reason: str, sent_at: datetime, settle_after: timedelta | None, now: datetime | None
) -> NotFound | Pending:
    """``reason`` as NotFound once the call is past ``settle_after``, else Pending. A
    call without a finite timeout (``settle_after`` None) may still be running: Pending."""
    if settle_after is None:
        return Pending(
            f"{reason}, but the call was sent with no finite timeout: it may still be "
            "running, so not finding it proves nothing (an operator resolves it)"
        )
    age = (now or datetime.now(UTC)) - sent_at
    if age < settle_after:
        return Pending(f"{reason}, but the attempt is {age} old (< {settle_after}): not yet")
    return NotFound(reason)


def status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None
