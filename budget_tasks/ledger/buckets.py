"""Time buckets in SQL: the start of a column's minute, hour or day in UTC on each
backend, and a bucket start read back as an aware UTC datetime."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func

#: How SQLite writes a time truncated to each unit.
_SQLITE_FORMAT = {
    "minute": "%Y-%m-%d %H:%M:00",
    "hour": "%Y-%m-%d %H:00:00",
    "day": "%Y-%m-%d 00:00:00",
}
#: The units a bucket can be.
UNITS = tuple(_SQLITE_FORMAT)


def bucket_start(dialect: str, unit: str, column: Any) -> Any:
    """The start of ``column``'s ``unit`` (one of :data:`UNITS`) in UTC, on each
    backend."""
    if dialect == "sqlite":
        # stored as UTC wall time (see UTCDateTime): text ordering is time ordering
        return func.strftime(_SQLITE_FORMAT[unit], column)
    return func.date_trunc(unit, column, "UTC")


def as_utc(value: Any) -> datetime:
    """A bucket start as read (a datetime, or SQLite's strftime text) in UTC."""
    if isinstance(value, str):  # SQLite's strftime
        value = datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
