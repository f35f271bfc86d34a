"""The fake provider's organisation reports, built from its own record as the real
admin APIs build theirs: OpenAI's usage (completions, embeddings) and costs reports and
its projects' API keys; Anthropic's messages usage report, cost report and API keys.
The key lists leave out what the real ones leave out unless asked (OpenAI: a key whose
owner has lost access to its project; Anthropic: archived and expired keys), and keys
are deleted (OpenAI) or archived and disabled (Anthropic) through the admin API.

Usage counts every request the fake billed (a cut connection's too: the work was done
and billed), by the model that answered, in buckets aligned to their width in UTC,
every bucket of the window listed (empty ones with ``results: []``). Costs are daily;
each model's work is two line items, ``input`` (every input token, cache reads and
writes, per-unit charges) and ``output`` (the output tokens at the model's rates), that
add up exactly to what the fake billed. OpenAI answers dollars as a JSON number,
Anthropic cents as a decimal string. Images and speech bill into the costs only (their
own usage reports, in images and characters, are not served).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Protocol

from ..pricing import Prices, Usage
from ..pricing.usage import PriceContext


class Served(Protocol):
    """What a report reads of one request the fake served (its ``Served`` record)."""

    @property
    def vendor(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def at(self) -> float: ...
    @property
    def key_id(self) -> str | None: ...
    @property
    def project(self) -> str | None: ...
    @property
    def bills(self) -> list[Bill]: ...


OPENAI = "openai"
ANTHROPIC = "anthropic"
#: The project a key belongs to unless added to another (Anthropic: the default
#: workspace, which its reports show as null).
DEFAULT_PROJECT = {OPENAI: "proj_default", ANTHROPIC: None}
#: The admin endpoints answer these keys only, as the real ones refuse a project's key.
ADMIN_PREFIXES = {OPENAI: "sk-admin-", ANTHROPIC: "sk-ant-admin"}

WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
#: (default, most) buckets in one page of a usage report, by bucket width
USAGE_LIMITS = {"1d": (7, 31), "1h": (24, 168), "1m": (60, 1440)}
#: (default, most) days in one page of a cost report
COST_LIMITS = {OPENAI: (7, 180), ANTHROPIC: (7, 31)}
#: (default, most) items in one page of a key or project list
LIST_LIMITS = {OPENAI: (20, 100), ANTHROPIC: (20, 1000)}
MICRO_PER_DOLLAR = 1_000_000
MICRO_PER_CENT = 10_000

#: Which billable paths each usage report counts.
USAGE_PATHS = {
    "completions": ("/v1/chat/completions", "/v1/responses", "/v1/completions"),
    "embeddings": ("/v1/embeddings",),
    "messages": ("/v1/messages", "/v1/messages/batches"),
}
#: What each report can be grouped by (the real APIs' lists).
USAGE_GROUPS = {
    "completions": ("project_id", "user_id", "api_key_id", "model", "batch"),
    "embeddings": ("project_id", "user_id", "api_key_id", "model"),
    "messages": ("api_key_id", "workspace_id", "model", "service_tier", "context_window"),
}
COST_GROUPS = {
    OPENAI: ("project_id", "user_id", "line_item", "api_key_id"),
    ANTHROPIC: ("workspace_id", "description"),
}
#: Anthropic fills these of a cost line only when it is grouped by description.
_DESCRIBED = ("model", "cost_type", "token_type", "service_tier", "context_window")


class ReportError(Exception):
    """A request the real API refuses (a limit too high, a page token not its own)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Bill:
    """One model's work in a request (a batch holds several): its usage (the fields the
    fake billed, non-zero ones), the charge, and the part of it for output, micro-USD."""

    model: str
    usage: dict[str, int]
    amount: int
    output: int
    batch: bool = False


def bill_of(
    prices: Prices, provider: str, model: str, usage: Usage, context: PriceContext, amount: int
) -> Bill:
    """The bill of ``usage`` charged ``amount``: its output priced on its own (never
    more than the whole, so the input line, the rest, is never negative)."""
    output = Usage(
        output_tokens=usage.output_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        output_audio_tokens=usage.output_audio_tokens,
        output_image_tokens=usage.output_image_tokens,
    )
    part = (
        prices.cost(model, output, provider=provider, context=context) if usage.output_tokens else 0
    )
    used = {k: v for k, v in asdict(usage).items() if v}
    return Bill(model, used, amount, min(part, amount), context.batch)


def admin_answer(
    segments: Sequence[str],
    query: Mapping[str, list[str]],
    keys: Keys,
    served: Callable[[], Sequence[Served]],
    *,
    method: str = "GET",
    body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The answer to an admin request (its path's ``segments``), over the requests
    ``served`` returns (those a report may show): a report or key list (``GET``), a
    key deleted (OpenAI's ``DELETE``) or its status changed (Anthropic's ``POST``)."""
    match [method, *segments]:
        case ["GET", "v1", "organization", "usage", ("completions" | "embeddings") as report]:
            return usage_page(OPENAI, report, query, served())
        case ["GET", "v1", "organization", "costs"]:
            return cost_page(OPENAI, query, served())
        case ["GET", "v1", "organization", "projects"]:
            return openai_projects(keys, query)
        case ["GET", "v1", "organization", "projects", project, "api_keys"]:
            return openai_project_keys(keys, project, query)
        case ["DELETE", "v1", "organization", "projects", project, "api_keys", key_id]:
            return openai_delete_key(keys, project, key_id)
        case ["GET", "v1", "organizations", "usage_report", "messages"]:
            return usage_page(ANTHROPIC, "messages", query, served())
        case ["GET", "v1", "organizations", "cost_report"]:
            return cost_page(ANTHROPIC, query, served())
        case ["GET", "v1", "organizations", "api_keys"]:
            return anthropic_keys(keys, query)
        case ["POST", "v1", "organizations", "api_keys", key_id]:
            return anthropic_update_key(keys, key_id, body or {})
    raise ReportError(404, f"no route {method} /{'/'.join(segments)}")


# -- keys ------------------------------------------------------------------------------

#: Anthropic's statuses of a key; only an active key is served.
KEY_STATUSES = ("active", "inactive", "archived", "expired")
#: The statuses an unfiltered Anthropic key list leaves out: the API's documentation
#: does not say what a list without ``status`` holds, so the fake takes the harder
#: reading (a reader that wants every key asks for these too).
LISTED_ONLY_WHEN_ASKED = ("archived", "expired")
#: Whether an OpenAI key's owner still has access to its project. OpenAI's project key
#: list leaves out the keys of owners without it unless asked (``owner_project_access``
#: ``inactive`` or ``any``); such keys still work.
OWNER_ACCESS = ("active", "inactive")


@dataclass(frozen=True)
class Key:
    """An API key of the fake organisation (its secret stays in the registry)."""

    id: str
    vendor: str
    project: str | None
    created_at: int
    secret: str
    status: str = "active"
    owner_access: str = "active"


def redacted_value(secret: str) -> str:
    """OpenAI's hint of a key: its first 6 and last 4 characters."""
    return f"{secret[:6]}...{secret[-4:]}"


def partial_key_hint(secret: str) -> str:
    """Anthropic's hint of a key: its first 16 and last 4 characters."""
    return f"{secret[:16]}...{secret[-4:]}"


class Keys:
    """The organisation's API keys by vendor: added by a test, or on first use (in the
    default project). A deleted key is gone from every list and refused, as the real
    APIs refuse it; its past traffic keeps its id in the reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str], Key] = {}
        self._deleted: set[tuple[str, str]] = set()
        #: every project a key was added to: a project outlives its keys
        self._projects: set[tuple[str, str | None]] = set()

    def add(
        self,
        secret: str,
        vendor: str,
        project: str | None = None,
        *,
        owner_access: str = "active",
    ) -> Key:
        """Register (or move) ``secret``'s key; None: the vendor's default project."""
        if vendor not in DEFAULT_PROJECT:
            raise ValueError(f"vendor must be {OPENAI!r} or {ANTHROPIC!r}, not {vendor!r}")
        if owner_access not in OWNER_ACCESS:
            raise ValueError(f"owner_access must be one of {OWNER_ACCESS}, not {owner_access!r}")
        digest = hashlib.sha256(secret.encode()).hexdigest()
        key_id = f"key_{digest[:16]}" if vendor == OPENAI else f"apikey_01{digest[:22]}"
        project = project or DEFAULT_PROJECT[vendor]
        key = Key(key_id, vendor, project, int(time.time()), secret, owner_access=owner_access)
        with self._lock:
            self._keys[(vendor, secret)] = key
            self._deleted.discard((vendor, secret))
            self._projects.add((vendor, project))
        return key

    def seen(self, secret: str, vendor: str) -> Key | None:
        """``secret``'s key, added to the default project on first sight; None for a
        key deleted."""
        with self._lock:
            if (vendor, secret) in self._deleted:
                return None
            key = self._keys.get((vendor, secret))
        return key if key is not None else self.add(secret, vendor)

    def of(self, vendor: str) -> list[Key]:
        with self._lock:
            return sorted((k for k in self._keys.values() if k.vendor == vendor), key=_by_id)

    def projects(self, vendor: str) -> set[str | None]:
        with self._lock:
            return {project for kind, project in self._projects if kind == vendor}

    def find(self, vendor: str, key_id: str) -> Key | None:
        return next((k for k in self.of(vendor) if k.id == key_id), None)

    def delete(self, vendor: str, key_id: str) -> Key | None:
        """Delete the key ``key_id``: None if there is none."""
        with self._lock:
            found = next(
                (k for k in self._keys.values() if (k.vendor, k.id) == (vendor, key_id)), None
            )
            if found is not None:
                del self._keys[(vendor, found.secret)]
                self._deleted.add((vendor, found.secret))
            return found

    def change(
        self, key: Key, *, status: str | None = None, owner_access: str | None = None
    ) -> Key:
        """``key`` with a new ``status`` (Anthropic) or ``owner_access`` (OpenAI)."""
        changed = replace(
            key,
            status=status or key.status,
            owner_access=owner_access or key.owner_access,
        )
        with self._lock:
            if (key.vendor, key.secret) in self._keys:
                self._keys[(key.vendor, key.secret)] = changed
        return changed

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
            self._deleted.clear()
            self._projects.clear()


def _by_id(key: Key) -> str:
    return key.id


def openai_projects(keys: Keys, query: Mapping[str, list[str]]) -> dict[str, Any]:
    """``GET /v1/organization/projects``: the default project and every key's."""
    names = sorted({str(DEFAULT_PROJECT[OPENAI]), *map(str, keys.projects(OPENAI))})
    projects = [
        {
            "id": name,
            "object": "organization.project",
            "name": name,
            "created_at": 0,
            "archived_at": None,
            "status": "active",
        }
        for name in names
    ]
    return {"object": "list", **_listed(projects, query, "after", LIST_LIMITS[OPENAI])}


def _openai_key(key: Key) -> dict[str, Any]:
    return {
        "object": "organization.project.api_key",
        "id": key.id,
        "name": f"key {key.id[-6:]}",
        "redacted_value": redacted_value(key.secret),
        "created_at": key.created_at,
        "last_used_at": None,
        "owner": {"type": "user", "user": {"id": "user_fake", "name": "Fake"}},
        "owner_project_access": key.owner_access,
    }


def openai_project_keys(keys: Keys, project: str, query: Mapping[str, list[str]]) -> dict[str, Any]:
    """``GET /v1/organization/projects/{id}/api_keys``: without ``owner_project_access``
    only the keys whose owner still has access to the project, as the real list's
    membership rules leave some enabled keys out."""
    if project not in {DEFAULT_PROJECT[OPENAI], *keys.projects(OPENAI)}:
        raise ReportError(404, f"No such project: {project}")
    access = _one(query, "owner_project_access") or "active"
    if access not in (*OWNER_ACCESS, "any"):
        raise ReportError(
            400, f"owner_project_access must be active, inactive or any, not {access!r}"
        )
    listed = [
        _openai_key(k)
        for k in keys.of(OPENAI)
        if k.project == project and access in ("any", k.owner_access)
    ]
    return {"object": "list", **_listed(listed, query, "after", LIST_LIMITS[OPENAI])}


def openai_delete_key(keys: Keys, project: str, key_id: str) -> dict[str, Any]:
    """``DELETE /v1/organization/projects/{id}/api_keys/{key_id}``."""
    key = keys.find(OPENAI, key_id)
    if key is None or key.project != project:
        raise ReportError(404, f"No such API key: {key_id}")
    keys.delete(OPENAI, key_id)
    return {"object": "organization.project.api_key.deleted", "id": key_id, "deleted": True}


def _anthropic_key(key: Key) -> dict[str, Any]:
    return {
        "id": key.id,
        "type": "api_key",
        "name": f"key {key.id[-6:]}",
        # as the installed SDK's APIKey: where it belongs is its scope (this fake's
        # default workspace has no id, as the usage reports name none)
        "scope": {"type": "workspace", "workspace_id": key.project}
        if key.project
        else {"type": "organization"},
        "partial_key_hint": partial_key_hint(key.secret),
        "status": key.status,
        "created_at": _rfc3339(key.created_at),
        "created_by": {"id": "user_fake", "type": "user"},
    }


def anthropic_keys(keys: Keys, query: Mapping[str, list[str]]) -> dict[str, Any]:
    """``GET /v1/organizations/api_keys``, of one ``status`` where asked (unasked:
    none of :data:`LISTED_ONLY_WHEN_ASKED`)."""
    status = _one(query, "status")
    if status is not None and status not in KEY_STATUSES:
        raise ReportError(400, f"status must be one of {', '.join(KEY_STATUSES)}")
    listed = [
        _anthropic_key(k)
        for k in keys.of(ANTHROPIC)
        if k.status == status or (status is None and k.status not in LISTED_ONLY_WHEN_ASKED)
    ]
    return _listed(listed, query, "after_id", LIST_LIMITS[ANTHROPIC])


def anthropic_update_key(keys: Keys, key_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST /v1/organizations/api_keys/{id}``: its status changed (an archived key
    stays archived)."""
    key = keys.find(ANTHROPIC, key_id)
    if key is None:
        raise ReportError(404, f"No such API key: {key_id}")
    status = body.get("status")
    if status is None:
        return _anthropic_key(key)
    if status not in ("active", "inactive", "archived"):
        raise ReportError(400, "status must be active, inactive or archived")
    if key.status == "archived" and status != "archived":
        raise ReportError(400, "an archived API key cannot be changed")
    return _anthropic_key(keys.change(key, status=status))


def _listed(
    items: list[dict[str, Any]], query: Mapping[str, list[str]], after: str, limits: tuple[int, int]
) -> dict[str, Any]:
    limit = _limit(query, limits)
    mark = _one(query, after)
    if mark is not None:
        ids = [item["id"] for item in items]
        if mark not in ids:
            raise ReportError(400, f"{after} {mark!r} is not an id of this list")
        items = items[ids.index(mark) + 1 :]
    page = items[:limit]
    return {
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


# -- usage and cost reports --------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    """One thing a report sums: when, what it can be grouped by, and its numbers."""

    at: float
    fields: dict[str, Any]
    numbers: dict[str, int]


def usage_page(
    vendor: str, report: str, query: Mapping[str, list[str]], served: Sequence[Served]
) -> dict[str, Any]:
    """One page of a usage report (``completions``, ``embeddings``: OpenAI;
    ``messages``: Anthropic) over the billed requests ``served``."""
    width = _one(query, "bucket_width") or "1d"
    if width not in WIDTHS:
        raise ReportError(400, f"bucket_width must be one of {', '.join(WIDTHS)}")
    items = [
        _usage_item(report, record, bill)
        for record in served
        if record.vendor == vendor and record.path in USAGE_PATHS[report]
        for bill in list(record.bills)
    ]
    finish = _openai_usage if vendor == OPENAI else _anthropic_usage
    obj = f"organization.usage.{report}.result"
    limits = USAGE_LIMITS[width]
    return _page(
        vendor, query, width, limits, USAGE_GROUPS[report], items, lambda r: finish(r, obj)
    )


def cost_page(
    vendor: str, query: Mapping[str, list[str]], served: Sequence[Served]
) -> dict[str, Any]:
    """One page of a daily cost report over the billed requests ``served``."""
    if (_one(query, "bucket_width") or "1d") != "1d":
        raise ReportError(400, "bucket_width must be 1d")
    items = [
        item
        for record in served
        if record.vendor == vendor
        for bill in list(record.bills)
        for item in _cost_items(vendor, record, bill)
    ]
    finish = _openai_cost if vendor == OPENAI else _anthropic_cost
    return _page(vendor, query, "1d", COST_LIMITS[vendor], COST_GROUPS[vendor], items, finish)


def _usage_item(report: str, record: Served, bill: Bill) -> _Item:
    used = Usage(**bill.usage)
    if report == "embeddings":
        fields: dict[str, Any] = {
            "project_id": record.project,
            "user_id": None,
            "api_key_id": record.key_id,
            "model": bill.model,
        }
        numbers = {"input_tokens": used.input_tokens, "num_model_requests": 1}
        return _Item(record.at, fields, numbers)
    if report == "completions":
        fields = {
            "project_id": record.project,
            "user_id": None,
            "api_key_id": record.key_id,
            "model": bill.model,
            "batch": bill.batch,
        }
        numbers = {
            # OpenAI's input_tokens hold cached, cache-write and audio tokens too
            "input_tokens": used.total_input_tokens,
            "output_tokens": used.output_tokens,
            "input_cached_tokens": used.cached_input_tokens,
            "input_audio_tokens": used.input_audio_tokens,
            "output_audio_tokens": used.output_audio_tokens,
            "num_model_requests": 1,
        }
        return _Item(record.at, fields, numbers)
    fields = {
        "api_key_id": record.key_id,
        "workspace_id": record.project,
        "model": bill.model,
        "service_tier": "batch" if bill.batch else "standard",
        "context_window": "0-200k",
    }
    numbers = {
        "uncached_input_tokens": used.input_tokens,
        "cache_read_input_tokens": used.cached_input_tokens,
        "ephemeral_5m_input_tokens": used.cache_write_tokens,
        "ephemeral_1h_input_tokens": used.cache_write_1h_tokens,
        "output_tokens": used.output_tokens,
        "web_search_requests": used.web_searches,
    }
    return _Item(record.at, fields, numbers)


def _cost_items(vendor: str, record: Served, bill: Bill) -> list[_Item]:
    items = []
    for part, amount in (("input", bill.amount - bill.output), ("output", bill.output)):
        if not amount:
            continue
        if vendor == OPENAI:
            fields: dict[str, Any] = {
                "project_id": record.project,
                "user_id": None,
                "line_item": f"{bill.model}, {part}",
                "api_key_id": record.key_id,
            }
        else:
            fields = {
                "workspace_id": record.project,
                # one description a model, part and tier: what the line's other fields say
                "description": f"{bill.model} Usage - {part.title()} Tokens"
                + (", Batch" if bill.batch else ""),
                "model": bill.model,
                "cost_type": "tokens",
                "token_type": "uncached_input_tokens" if part == "input" else "output_tokens",
                "service_tier": "batch" if bill.batch else "standard",
                "context_window": "0-200k",
            }
        items.append(_Item(record.at, fields, {"amount": amount}))
    return items


def _openai_usage(row: dict[str, Any], obj: str) -> dict[str, Any]:
    return {"object": obj, **row}


def _anthropic_usage(row: dict[str, Any], obj: str) -> dict[str, Any]:
    cache = {
        "ephemeral_1h_input_tokens": row.pop("ephemeral_1h_input_tokens"),
        "ephemeral_5m_input_tokens": row.pop("ephemeral_5m_input_tokens"),
    }
    searches = {"web_search_requests": row.pop("web_search_requests")}
    return {**row, "cache_creation": cache, "server_tool_use": searches}


def _openai_cost(row: dict[str, Any]) -> dict[str, Any]:
    micro = row.pop("amount")
    # a float carries any amount the fake bills exactly (fewer than 16 digits): its
    # JSON is the decimal, as the real API's number is
    value = micro / MICRO_PER_DOLLAR
    return {
        "object": "organization.costs.result",
        "amount": {"value": value, "currency": "usd"},
        **row,
    }


def _anthropic_cost(row: dict[str, Any]) -> dict[str, Any]:
    cents = Decimal(row.pop("amount")).scaleb(-4)  # micro-USD -> cents
    return {"currency": "USD", "amount": format(cents, "f"), **row}


def _page(
    vendor: str,
    query: Mapping[str, list[str]],
    width_name: str,
    limits: tuple[int, int],
    allowed: tuple[str, ...],
    items: Iterable[_Item],
    finish: Callable[[dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """One page of buckets of ``items``, grouped as asked, each row ``finish``ed."""
    width = WIDTHS[width_name]
    limit = _limit(query, limits)
    groups = tuple(dict.fromkeys([*query.get("group_by", []), *query.get("group_by[]", [])]))
    unknown = [g for g in groups if g not in allowed]
    if unknown:
        raise ReportError(400, f"cannot group by {', '.join(unknown)}")
    start, end = _window(vendor, query)
    first = start - start % width
    token = _one(query, "page")
    if token is not None:
        first = _page_start(token, first, end, width)
    starts = range(first, end, width)
    by_bucket: dict[int, list[_Item]] = {}
    for item in items:
        by_bucket.setdefault(int(item.at // width) * width, []).append(item)
    shown = set(groups) | (set(_DESCRIBED) if "description" in groups else set())
    data = []
    for bucket in starts[:limit]:
        rows = _rows(by_bucket.get(bucket, []), groups, shown)
        if vendor == OPENAI:
            times: dict[str, Any] = {
                "object": "bucket",
                "start_time": bucket,
                "end_time": bucket + width,
            }
        else:
            times = {"starting_at": _rfc3339(bucket), "ending_at": _rfc3339(bucket + width)}
        data.append({**times, "results": [finish(row) for row in rows]})
    more = len(starts) > limit
    page = {"data": data, "has_more": more, "next_page": _token(starts[limit]) if more else None}
    return {"object": "page", **page} if vendor == OPENAI else page


def _rows(items: list[_Item], groups: tuple[str, ...], shown: set[str]) -> list[dict[str, Any]]:
    """The items summed by the values of ``groups``; a field not grouped by is null."""
    summed: dict[tuple[Any, ...], dict[str, Any]] = {}
    for item in items:
        key = tuple(item.fields[g] for g in groups)
        row = summed.get(key)
        if row is None:
            fields = {k: (v if k in shown else None) for k, v in item.fields.items()}
            row = summed[key] = {**fields, **dict.fromkeys(item.numbers, 0)}
        for name, value in item.numbers.items():
            row[name] += value
    return [summed[key] for key in sorted(summed, key=lambda k: [str(v) for v in k])]


def _window(vendor: str, query: Mapping[str, list[str]]) -> tuple[int, int]:
    """The asked ``[start, end)`` in unix seconds (no end: until now)."""
    if vendor == OPENAI:
        start, end = _one(query, "start_time"), _one(query, "end_time")
        if start is None or not start.isdigit() or (end is not None and not end.isdigit()):
            raise ReportError(400, "start_time (and end_time) must be unix seconds")
        begin, until = int(start), int(end) if end is not None else None
    else:
        start, end = _one(query, "starting_at"), _one(query, "ending_at")
        begin = _seconds(start, "starting_at")
        until = _seconds(end, "ending_at") if end is not None else None
    until = until if until is not None else int(time.time()) + 1
    if until <= begin:
        raise ReportError(400, "the window must end after it starts")
    return begin, until


def _seconds(text: str | None, name: str) -> int:
    try:
        when = datetime.fromisoformat(text or "")
    except ValueError:
        raise ReportError(400, f"{name} must be an RFC 3339 time") from None
    if when.tzinfo is None:
        raise ReportError(400, f"{name} must name its time zone")
    return int(when.timestamp())


def _limit(query: Mapping[str, list[str]], limits: tuple[int, int]) -> int:
    default, most = limits
    text = _one(query, "limit")
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise ReportError(400, f"limit must be between 1 and {most}, not {text}")
    return int(text)


def _token(bucket: int) -> str:
    return "page_" + base64.urlsafe_b64encode(_rfc3339(bucket).encode()).decode()


def _page_start(token: str, first: int, end: int, width: int) -> int:
    """The bucket a page token (:func:`_token`) starts at: one of this window's."""
    try:
        at = _seconds(base64.urlsafe_b64decode(token.removeprefix("page_")).decode(), "page")
    except (ReportError, binascii.Error, UnicodeDecodeError):
        raise ReportError(400, f"invalid page token {token!r}") from None
    if at < first or at >= end or (at - first) % width:
        raise ReportError(400, f"page token {token!r} is not of this report")
    return at


def _one(query: Mapping[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
