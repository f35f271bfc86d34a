"""Which unknown outcomes reconciliation cannot settle: they wait for a person."""

from __future__ import annotations

from typing import Any

from ..beat import look_up
from ..ledger import Attempt
from ..providers import Unknowable


class _WouldAsk(Exception):
    """The lookup would ask the provider: reconciliation can try it."""


def _no_clients(name: str) -> Any:
    raise _WouldAsk(name)


def by_hand(attempt: Attempt) -> str | None:
    """Why reconciliation cannot settle ``attempt``'s unknown outcome (None: it is not
    unknown, or beat's lookup would ask the provider about it). Decided by beat's own
    lookup with no client: what it answers without asking is final."""
    if attempt.state != "unknown":
        return None
    try:
        found = look_up(attempt, _no_clients)
    except _WouldAsk:
        return None
    return found.reason if isinstance(found, Unknowable) else None
