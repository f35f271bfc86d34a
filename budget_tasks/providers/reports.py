"""What a vendor's organisation usage and cost reports say, in one shape for every
vendor: lines of tokens (by window, model, API key and project) and lines of money
(by day, project and model), and the API keys the organisation holds, each with the
hint the vendor shows of it.

A vendor reads its reports with an admin key (``Vendor.admin_key_env``); the drift
check (:mod:`budget_tasks.drift`) compares them with the ledger. A report is outside
data: a count or amount that cannot be read raises UsageUnreadable, never reads as 0.

The ledger never keeps an API key; it keeps the key's *hint* (:func:`hint_of`), the
few characters at each end that the vendors' consoles show too. A hint the vendor
reports for a key is matched with the ledger's by :func:`hints_match`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

#: The bucket widths both vendors' usage reports offer; cost reports are daily.
BUCKETS: dict[str, timedelta] = {
    "1m": timedelta(minutes=1),
    "1h": timedelta(hours=1),
    "1d": timedelta(days=1),
}
#: What a drift can be grouped by, besides its window.
GROUPINGS = ("model", "api_key", "project")


@dataclass(frozen=True, slots=True)
class ReportQuery:
    """A report's window ``[start, end)``, its bucket width, and the groupings asked
    for (of :data:`GROUPINGS`)."""

    start: datetime
    end: datetime
    bucket: str = "1h"
    group_by: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bucket not in BUCKETS:
            raise ValueError(f"bucket must be one of {', '.join(BUCKETS)}, not {self.bucket!r}")
        unknown = set(self.group_by) - set(GROUPINGS)
        if unknown:
            raise ValueError(f"cannot group by {', '.join(sorted(unknown))}")
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise ValueError("a report's window needs aware datetimes (UTC)")
        if self.end <= self.start:
            raise ValueError("a report's window ends after it starts")


@dataclass(frozen=True, slots=True)
class UsageLine:
    """Tokens one bucket of a usage report counts for one group.

    ``input_tokens`` is every input token however billed (uncached, cache reads and
    cache writes); ``output_tokens`` includes reasoning. ``model`` is as the vendor
    reports it (a snapshot), ``project`` is OpenAI's project or Anthropic's workspace;
    each is None where the report was not grouped by it."""

    start: datetime
    end: datetime
    input_tokens: int
    output_tokens: int
    #: requests counted (None where the vendor's report does not count them: Anthropic's)
    requests: int | None = None
    model: str | None = None
    api_key_id: str | None = None
    project: str | None = None


@dataclass(frozen=True, slots=True)
class CostLine:
    """Money one day of a cost report counts for one group, in micro-USD (the vendor's
    decimal amount, rounded up to the micro-dollar; a credit is below 0). ``model``
    where the line says which model it is for (else None); ``line_item`` the vendor's
    own label; ``api_key_id`` where the report was grouped by key."""

    start: datetime
    end: datetime
    amount: int
    project: str | None = None
    model: str | None = None
    line_item: str | None = None
    api_key_id: str | None = None


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """An API key of the organisation as the vendor lists it: its id, the hint it shows
    of the key, and the project (workspace) it belongs to."""

    id: str
    hint: str
    project: str | None = None


#: At most this many characters of a key are kept from each end: what Anthropic's
#: console shows of a key (every Anthropic key begins ``sk-ant-api03-``: the head tells
#: two keys apart only past it).
_HINT_HEAD = 16
_HINT_TAIL = 4


def hint_of(secret: str) -> str:
    """The hint of an API key the ledger keeps: its first 16 and last 4 characters, and
    of a short key no more than a third at its head and a sixth at its tail (never the
    key)."""
    most = len(secret) // 3
    head = secret[: min(_HINT_HEAD, most)]
    tail = secret[len(secret) - min(_HINT_TAIL, most // 2) :] if most >= 2 else ""
    return f"{head}...{tail}"


def _ends(hint: str) -> tuple[str, str]:
    head, dots, tail = hint.partition("...")
    if not dots:  # no ellipsis: a hint that shows the start only
        return hint.rstrip("*"), ""
    return head.rstrip("*"), tail.lstrip("*")


def hints_match(ours: str, theirs: str) -> bool:
    """Whether a vendor's hint of a key (``sk-abc...def``, masked with ``*`` or not)
    can be the key the ledger's hint (:func:`hint_of`) was taken of: each end of one
    is a prefix (suffix) of the other's, and they share at least one character."""
    head, tail = _ends(ours)
    their_head, their_tail = _ends(theirs)
    heads = head.startswith(their_head) or their_head.startswith(head)
    tails = tail.endswith(their_tail) or their_tail.endswith(tail)
    shared = min(len(head), len(their_head)) + min(len(tail), len(their_tail))
    return heads and tails and shared > 0


def key_for(hint: str, keys: Iterable[KeyInfo]) -> KeyInfo | None:
    """The one key of ``keys`` whose hint matches ``hint``; None where none does, or
    more than one (an ambiguous hint is not attributed)."""
    found = [key for key in keys if hints_match(hint, key.hint)]
    return found[0] if len(found) == 1 else None
