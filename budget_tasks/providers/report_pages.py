"""Reading a vendor's report pages: one answer's JSON (its fractions as Decimal: money
is never a float here), every page of a report or a list, and each field as the count,
text, time or amount it must be. A report is outside data: anything else raises
ReportUnreadable naming the vendor, the report and the field (never read as 0)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any

from ..errors import ReportUnreadable, UsageUnreadable
from .base import count_of
from .clients import require_no_retries

#: The most buckets one usage page may hold, by bucket width (both vendors).
USAGE_LIMITS = {"1d": 31, "1h": 168, "1m": 1440}


def page_limit(limit: int | None, most: int) -> int:
    """``limit`` items a page (None: the most the API allows)."""
    if limit is None:
        return most
    if not 1 <= limit <= most:
        raise ValueError(f"limit must be between 1 and {most}, not {limit}")
    return limit


class Pages:
    """One report of one vendor, read with ``admin`` (the SDK client, retries off)."""

    def __init__(self, admin: Any, vendor: str, report: str) -> None:
        require_no_retries(admin)
        self.admin = admin
        self.vendor = vendor
        self.report = report

    def unreadable(self, field: str, value: Any) -> ReportUnreadable:
        return ReportUnreadable(self.vendor, self.report, field, repr(value)[:80])

    def get(self, path: str, params: Mapping[str, Any]) -> Mapping[str, Any]:
        """One answer's JSON object."""
        text = self.admin.get(path, cast_to=str, options={"params": dict(params)})
        try:
            page = json.loads(text, parse_float=Decimal)
        except (TypeError, ValueError):
            raise self.unreadable(path, text) from None
        if not isinstance(page, Mapping):
            raise self.unreadable(path, page)
        return page

    def results(
        self,
        path: str,
        params: Mapping[str, Any],
        times: tuple[str, str],
        read_time: Callable[[Any], datetime | None],
    ) -> Iterator[tuple[datetime, datetime, Mapping[str, Any]]]:
        """Each result of each bucket of every page (``page``/``next_page``), with its
        bucket's start and end (the fields ``times``, read by ``read_time``)."""
        seen: set[str] = set()
        asked = dict(params)
        while True:
            page = self.get(path, asked)
            for bucket in self.items(page, "data"):
                start, end = (self.time(bucket, name, read_time) for name in times)
                for result in self.items(bucket, "results"):
                    yield start, end, result
            if not self.more(page):
                return
            asked["page"] = self.cursor(page, "next_page", seen)

    def listed(
        self, path: str, params: Mapping[str, Any], after: str
    ) -> Iterator[Mapping[str, Any]]:
        """Each item of every page of a list, paged with ``after`` (its ``last_id``)."""
        seen: set[str] = set()
        asked = dict(params)
        while True:
            page = self.get(path, asked)
            yield from self.items(page, "data")
            if not self.more(page):
                return
            asked[after] = self.cursor(page, "last_id", seen)

    def more(self, page: Mapping[str, Any]) -> bool:
        more = page.get("has_more")
        if not isinstance(more, bool):
            raise self.unreadable("has_more", more)
        return more

    def cursor(self, page: Mapping[str, Any], name: str, seen: set[str]) -> str:
        """The cursor to the next page: one never seen before (a page that leads back
        would be read, and counted, twice)."""
        token = page.get(name)
        if not isinstance(token, str) or not token or token in seen:
            raise self.unreadable(name, token)
        seen.add(token)
        return token

    def items(self, obj: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
        items = obj.get(name)
        if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
            raise self.unreadable(name, items)
        return items

    def time(
        self, obj: Mapping[str, Any], name: str, read: Callable[[Any], datetime | None]
    ) -> datetime:
        value = obj.get(name)
        try:
            when = read(value)
        except (TypeError, ValueError, OverflowError, OSError):
            when = None
        if when is None or when.tzinfo is None:
            raise self.unreadable(name, value)
        return when

    def count(
        self, obj: Mapping[str, Any], name: str, *, required: bool = True, field: str = ""
    ) -> int:
        value = obj.get(name)
        if value is None and required:
            raise self.unreadable(field or name, "missing")
        try:
            # a count with a fraction reads as count_of reads a float (rounded up)
            return count_of(float(value) if isinstance(value, Decimal) else value, name)
        except UsageUnreadable:
            raise self.unreadable(field or name, value) from None

    def text(self, obj: Mapping[str, Any], name: str) -> str | None:
        value = obj.get(name)
        if not isinstance(value, str | None):
            raise self.unreadable(name, value)
        return value

    def id(self, obj: Mapping[str, Any]) -> str:
        value = obj.get("id")
        if not isinstance(value, str) or not value:
            raise self.unreadable("id", value)
        return value

    def micro_usd(self, value: Any, currency: Any, per_unit: int, fields: tuple[str, str]) -> int:
        """An amount in USD, ``per_unit`` micro-USD a unit (dollars, cents), as a whole
        number of micro-USD rounded up (a credit, below 0, too); an endless amount, or
        another currency, is refused. ``fields``: where the value and the currency were read."""
        field, currency_field = fields
        if not isinstance(currency, str) or currency.upper() != "USD":
            raise self.unreadable(currency_field, currency)
        try:
            if isinstance(value, bool) or not isinstance(value, int | Decimal | str):
                raise TypeError(value)
            amount = Decimal(value)
            if not amount.is_finite():
                raise ValueError(value)
            return int((amount * per_unit).to_integral_value(rounding=ROUND_CEILING))
        except (TypeError, ValueError, ArithmeticError):
            raise self.unreadable(field, value) from None
