"""An operator's resolution of a held attempt, one code path for every place an
operator acts from (``budget-tasks resolve``, the dashboard)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BudgetTasksError
from .hooks import hooks
from .ledger import Attempt
from .ledger.records import Resolved


class NeverSent(BudgetTasksError, ValueError):
    """A charge for an attempt that was never sent (reserved): it can only be released."""

    template = "{key} was never sent (reserved): it can only be released (--actual 0)"
    key: str


@dataclass(frozen=True, slots=True)
class Resolution:
    """The attempt as the operator saw it, what the ledger did, and the attempt after."""

    before: Attempt
    done: Resolved
    after: Attempt


def resolve_outcome(
    ledger: Any, attempt: str, actual: int, note: str, by: str | None = None
) -> Resolution:
    """Settle ``attempt`` at ``actual`` (0: release it) with ``note``, as operator ``by``
    (default: the OS user and host), compare-and-set on the state read first: if it
    moved since, nothing changes and ``done.applied`` says so. ``ledger`` is a
    :class:`~budget_tasks.Ledger`."""
    before = ledger.attempt(attempt)
    if actual > 0 and before.state == "reserved":
        raise NeverSent(attempt)
    done: Resolved = ledger.resolve_attempt(
        attempt, actual, note=note, by="operator", expected=before.state, actor=by
    )
    if done.applied:
        if done.state == "settled":
            hooks.settled(
                budget=before.budget,
                attempt=attempt,
                amount=before.amount,
                actual=actual,
                by="operator",
            )
        else:
            hooks.released(
                budget=before.budget, attempt=attempt, amount=before.amount, by="operator"
            )
    return Resolution(before, done, ledger.attempt(attempt))
