"""Official SDK clients with automatic retries off, and the check that refuses others."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..errors import RetriesEnabled

#: How long after a call's own timeout a provider may still be working on it.
DEFAULT_MARGIN = timedelta(minutes=5)


def require_no_retries(client: Any) -> Any:
    """Return ``client`` if its SDK retries are off; raise RetriesEnabled otherwise."""
    retries = getattr(client, "max_retries", None)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries != 0:
        raise RetriesEnabled(type(client).__name__, retries)
    return client


def client_timeout(client: Any) -> float | None:
    """The longest a call made with ``client`` can take before it gives up, in seconds
    (an ``httpx.Timeout``'s parts added up), or None if it has no finite timeout."""
    timeout = getattr(client, "timeout", None)
    if isinstance(timeout, bool):
        return None
    if isinstance(timeout, int | float):
        return float(timeout)
    parts = [getattr(timeout, name, None) for name in ("read", "write", "connect", "pool")]
    known = [float(p) for p in parts if isinstance(p, int | float) and not isinstance(p, bool)]
    return sum(known) if known else None


def settle_after(client: Any, margin: timedelta = DEFAULT_MARGIN) -> timedelta:
    """The longest a provider may still be working on a call made with ``client``:
    its timeout plus ``margin``. Before that, "not found" only means "not yet"."""
    seconds = client_timeout(client)
    if seconds is None:
        raise ValueError(f"{type(client).__name__} has no finite timeout to bound a call by")
    return timedelta(seconds=seconds) + margin
