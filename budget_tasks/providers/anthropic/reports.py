"""Anthropic's organisation usage and cost reports and its API keys, read with an
admin key through the SDK's own requests, every page of each.

A usage result's input is every input token: uncached, cache reads and both cache
writes; the report does not count requests. A cost amount is a decimal string of cents
(the currency's lowest unit); costs are grouped by description, so each line names its
model. A workspace is the project (null: the default workspace).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ..report_pages import USAGE_LIMITS, Pages, page_limit
from ..reports import CostLine, KeyInfo, ReportQuery, UsageLine

USAGE = "/v1/organizations/usage_report/messages"
COSTS = "/v1/organizations/cost_report"
KEYS = "/v1/organizations/api_keys"
#: The most days of costs a page holds; the most keys of a list (the API refuses more).
COSTS_LIMIT = 31
LIST_LIMIT = 1000
MICRO_PER_CENT = 10_000
#: What a report is grouped by, in the API's names.
_GROUPS = {"model": "model", "api_key": "api_key_id", "project": "workspace_id"}
_CACHE_WRITES = ("ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens")
_TIMES = ("starting_at", "ending_at")


def _rfc3339(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _window(query: ReportQuery) -> dict[str, str]:
    return {"starting_at": _at(query.start), "ending_at": _at(query.end)}


def _at(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


def usage_report(admin: Any, query: ReportQuery, *, limit: int | None = None) -> list[UsageLine]:
    """Messages usage over ``query``, ``limit`` buckets a page (None: the most the API
    allows)."""
    pages = Pages(admin, "anthropic", "usage")
    params: dict[str, Any] = {
        **_window(query),
        "bucket_width": query.bucket,
        "limit": page_limit(limit, USAGE_LIMITS[query.bucket]),
    }
    if query.group_by:
        params["group_by"] = [_GROUPS[name] for name in query.group_by]
    grouped = set(query.group_by)
    lines = []
    for start, end, result in pages.results(USAGE, params, _TIMES, _rfc3339):
        cache = result.get("cache_creation")
        if not isinstance(cache, Mapping | None):
            raise pages.unreadable("cache_creation", cache)
        writes = sum(
            pages.count(cache or {}, name, required=False, field=f"cache_creation.{name}")
            for name in _CACHE_WRITES
        )
        read = pages.count(result, "cache_read_input_tokens", required=False)
        lines.append(
            UsageLine(
                start,
                end,
                input_tokens=pages.count(result, "uncached_input_tokens") + read + writes,
                output_tokens=pages.count(result, "output_tokens"),
                model=pages.text(result, "model") if "model" in grouped else None,
                api_key_id=pages.text(result, "api_key_id") if "api_key" in grouped else None,
                project=pages.text(result, "workspace_id") if "project" in grouped else None,
            )
        )
    return lines


def cost_report(admin: Any, query: ReportQuery, *, limit: int | None = None) -> list[CostLine]:
    """Costs by day over ``query``, by description (and workspace where asked)."""
    pages = Pages(admin, "anthropic", "cost")
    by_project = "project" in query.group_by
    params = {
        **_window(query),
        "bucket_width": "1d",
        "group_by": ["description", "workspace_id"] if by_project else ["description"],
        "limit": page_limit(limit, COSTS_LIMIT),
    }
    return [
        CostLine(
            start,
            end,
            pages.micro_usd(
                result.get("amount"), result.get("currency"), MICRO_PER_CENT, ("amount", "currency")
            ),
            project=pages.text(result, "workspace_id") if by_project else None,
            model=pages.text(result, "model"),
            line_item=pages.text(result, "description"),
        )
        for start, end, result in pages.results(COSTS, params, _TIMES, _rfc3339)
    ]


#: The statuses a key never leaves: asked for apart, after the list of the others.
_FINAL_STATUSES = ("archived", "expired")


def api_keys(admin: Any) -> list[KeyInfo]:
    """Every API key of the organisation, whatever its status (a key since disabled or
    archived may have spent in a window being checked), with its partial hint and
    workspace. The documentation does not say that a list without ``status`` holds
    archived and expired keys, so they are asked for too; a key is kept once. They are
    asked for last: a key archived while the keys are read is in one list or the
    other."""
    pages = Pages(admin, "anthropic", "API keys")
    found: dict[str, KeyInfo] = {}
    for status in (None, *_FINAL_STATUSES):
        params: dict[str, Any] = {"limit": LIST_LIMIT}
        if status is not None:
            params["status"] = status
        for key in pages.listed(KEYS, params, "after_id"):
            key_id = pages.id(key)
            hint = pages.text(key, "partial_key_hint") or ""  # none shown: never attributed
            found.setdefault(key_id, KeyInfo(key_id, hint, _workspace(pages, key)))
    return list(found.values())


def _workspace(pages: Pages, key: Mapping[str, Any]) -> str | None:
    """The workspace a key belongs to: its ``scope``'s (the SDK's APIKey), else the
    ``workspace_id`` older answers carry; None for an organisation-scoped key."""
    scope = key.get("scope")
    if scope is None:
        return pages.text(key, "workspace_id")
    if not isinstance(scope, Mapping):
        raise pages.unreadable("scope", scope)
    return pages.text(scope, "workspace_id")
