"""OpenAI's organisation usage and cost reports and its projects' API keys, read with
an admin key through the SDK's own requests, every page of each.

Usage is the completions report (chat, Responses, legacy completions) and the
embeddings report. Their ``input_tokens`` hold every input token (cached, cache-write,
audio and image ones too) and ``output_tokens`` every output token, as the installed
SDK's types describe them: nothing is added to them. Costs are daily, grouped by line
item (``gpt-4o-mini-2024-07-18, input``: the model is the part before the last comma);
an amount is ``{"value": dollars, "currency": "usd"}``.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from ..report_pages import USAGE_LIMITS, Pages, page_limit
from ..reports import CostLine, KeyInfo, ReportQuery, UsageLine

COMPLETIONS = "/organization/usage/completions"
EMBEDDINGS = "/organization/usage/embeddings"
COSTS = "/organization/costs"
PROJECTS = "/organization/projects"
#: The most days of costs a page holds; the most items of a list (the API refuses more).
COSTS_LIMIT = 180
LIST_LIMIT = 100
MICRO_PER_DOLLAR = 1_000_000
#: What a report is grouped by, in the API's names.
_GROUPS = {"model": "model", "api_key": "api_key_id", "project": "project_id"}
_TIMES = ("start_time", "end_time")


def _unix(value: Any) -> datetime | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return datetime.fromtimestamp(value, UTC)


def _window(query: ReportQuery) -> dict[str, int]:
    """The window in unix seconds, widened to whole seconds."""
    return {
        "start_time": math.floor(query.start.timestamp()),
        "end_time": math.ceil(query.end.timestamp()),
    }


def usage_report(admin: Any, query: ReportQuery, *, limit: int | None = None) -> list[UsageLine]:
    """Completions and embeddings usage over ``query``, ``limit`` buckets a page (None:
    the most the API allows)."""
    pages = Pages(admin, "openai", "usage")
    params: dict[str, Any] = {
        **_window(query),
        "bucket_width": query.bucket,
        "limit": page_limit(limit, USAGE_LIMITS[query.bucket]),
    }
    if query.group_by:
        params["group_by"] = [_GROUPS[name] for name in query.group_by]
    grouped = set(query.group_by)
    return [
        UsageLine(
            start,
            end,
            input_tokens=pages.count(result, "input_tokens"),
            # embeddings have no output
            output_tokens=pages.count(result, "output_tokens", required=path == COMPLETIONS),
            requests=pages.count(result, "num_model_requests"),
            model=pages.text(result, "model") if "model" in grouped else None,
            api_key_id=pages.text(result, "api_key_id") if "api_key" in grouped else None,
            project=pages.text(result, "project_id") if "project" in grouped else None,
        )
        for path in (COMPLETIONS, EMBEDDINGS)
        for start, end, result in pages.results(path, params, _TIMES, _unix)
    ]


def cost_report(admin: Any, query: ReportQuery, *, limit: int | None = None) -> list[CostLine]:
    """Costs by day over ``query``, by line item (and project, API key where asked)."""
    pages = Pages(admin, "openai", "cost")
    by_project, by_key = "project" in query.group_by, "api_key" in query.group_by
    grouped = ["line_item"] + (["project_id"] if by_project else [])
    params = {
        **_window(query),
        "bucket_width": "1d",
        "group_by": grouped + (["api_key_id"] if by_key else []),
        "limit": page_limit(limit, COSTS_LIMIT),
    }
    lines = []
    for start, end, result in pages.results(COSTS, params, _TIMES, _unix):
        item = pages.text(result, "line_item")
        model = item.rpartition(", ")[0] if item else ""
        amount = result.get("amount")
        if not isinstance(amount, dict):
            raise pages.unreadable("amount", amount)
        lines.append(
            CostLine(
                start,
                end,
                pages.micro_usd(
                    amount.get("value"),
                    amount.get("currency"),
                    MICRO_PER_DOLLAR,
                    ("amount.value", "amount.currency"),
                ),
                project=pages.text(result, "project_id") if by_project else None,
                model=model or None,
                line_item=item,
                api_key_id=pages.text(result, "api_key_id") if by_key else None,
            )
        )
    return lines


def api_keys(admin: Any) -> list[KeyInfo]:
    """Every project's API keys (archived projects' too: their keys may have spent in a
    window being checked), each with its redacted value as its hint. Asked with
    ``owner_project_access=any``: without it the list leaves out enabled keys whose
    owner has lost access to the project, and those keys still spend. A deleted key is
    in no list: its traffic is the reports' alone (see the drift check)."""
    pages = Pages(admin, "openai", "API keys")
    keys = []
    listed = {"include_archived": True, "limit": LIST_LIMIT}
    every = {"limit": LIST_LIMIT, "owner_project_access": "any"}
    for project in pages.listed(PROJECTS, listed, "after"):
        project_id = pages.id(project)
        path = f"{PROJECTS}/{quote(project_id, safe='')}/api_keys"
        for key in pages.listed(path, every, "after"):
            hint = pages.text(key, "redacted_value") or ""  # none shown: never attributed
            keys.append(KeyInfo(pages.id(key), hint, project_id))
    return keys
