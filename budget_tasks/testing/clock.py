"""A clock that tests move by hand, for period boundaries and hold ages."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta


class ManualClock:
    """Call it for the current time; ``advance()`` moves it. Pass as ``Ledger(clock=...)``."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = (start or datetime(2026, 1, 1, 12, tzinfo=UTC)).astimezone(UTC)
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta | None = None, **kwargs: float) -> datetime:
        """Move forward by ``delta`` or by timedelta keyword arguments (``days=1``)."""
        with self._lock:
            self._now += delta if delta is not None else timedelta(**kwargs)
            return self._now
