"""What a provider's answer says of its rate limits, in one shape for every vendor: for
each limit it names (requests, tokens, input or output tokens per minute) the limit,
what remains and when the window is full again, and for a 429 how long to wait.

Each vendor reads its own headers (``Vendor.rate_state``): OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (resets as Go durations,
``6m0s``), Anthropic's ``anthropic-ratelimit-{kind}-{limit,remaining,reset}`` (resets
as RFC 3339 times), and ``retry-after`` (seconds, or an HTTP date) with OpenAI's
``retry-after-ms``. Headers are outside data: a value that cannot be read is left out
(never read as 0 or as "unlimited"), and the rest of the state stands.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

from .._rate_ask import RATE_KINDS, RateSeen

#: The limits a provider's answer may name.
KINDS = RATE_KINDS
#: The longest wait a header is believed for (a day): past it, a header is not read.
MOST_WAIT = timedelta(days=1)

_COUNT = re.compile(r"[0-9]{1,18}")
_GO_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)")
_GO_UNITS = {
    "h": 3600.0,
    "m": 60.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "µs": 1e-6,
    "ns": 1e-9,
}


@dataclass(frozen=True, slots=True)
class Window:
    """One limit as an answer told it: the limit, what remains, and how long until it
    is full again (None where the answer did not say)."""

    limit: int | None = None
    remaining: int | None = None
    reset_in: timedelta | None = None


@dataclass(frozen=True, slots=True)
class RateState:
    """What one answer said of its rate limits (see the module)."""

    windows: Mapping[str, Window] = field(default_factory=dict)
    #: a 429's (or 529's) ``retry-after``: how long to wait before sending again
    retry_after: timedelta | None = None

    @property
    def empty(self) -> bool:
        return not self.windows and self.retry_after is None


def count(value: str | None) -> int | None:
    """A header's whole, non-negative count; None where it is not one."""
    if value is None:
        return None
    text = value.strip()
    # ASCII digits only: str.isdigit would take "²"
    return int(text) if _COUNT.fullmatch(text) else None


def go_duration(value: str | None) -> timedelta | None:
    """A Go duration (``6m0s``, ``1.5s``, ``12ms``) as OpenAI's resets write them; None
    where it is not one, or past :data:`MOST_WAIT`."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text == "0":
        return timedelta(0)
    seconds, at = 0.0, 0
    for found in _GO_PART.finditer(text):
        if found.start() != at:
            return None
        seconds += float(found[1]) * _GO_UNITS[found[2]]
        at = found.end()
    if at != len(text) or not math.isfinite(seconds) or seconds > MOST_WAIT.total_seconds():
        return None
    return _believable(timedelta(seconds=seconds))


def until(value: str | None, now: datetime) -> timedelta | None:
    """An RFC 3339 time (Anthropic's resets) as the wait from ``now`` (0 where it has
    passed); None where it is not one, or past :data:`MOST_WAIT`."""
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return _believable(max(at - now, timedelta(0)))


def retry_after(headers: Mapping[str, str], now: datetime) -> timedelta | None:
    """How long ``retry-after-ms`` or ``retry-after`` (seconds, or an HTTP date) says
    to wait, as the official SDKs read them; None where neither can be read."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            wait = float(ms)
        except ValueError:
            wait = math.nan
        if math.isfinite(wait) and 0 <= wait <= MOST_WAIT.total_seconds() * 1000:
            return _believable(timedelta(milliseconds=wait))
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            at = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        return _believable(max(at - now, timedelta(0)))
    if not math.isfinite(seconds) or not 0 <= seconds <= MOST_WAIT.total_seconds():
        return None
    return _believable(timedelta(seconds=seconds))


def _believable(wait: timedelta) -> timedelta | None:
    return wait if wait <= MOST_WAIT else None


def lower(headers: Mapping[str, str]) -> dict[str, str]:
    """Header names in lower case (an httpx ``Headers`` is already; a dict may not be)."""
    return {str(k).lower(): str(v) for k, v in headers.items()}


def state_of(
    headers: Mapping[str, str],
    now: datetime,
    names: Mapping[str, tuple[str, str, str]],
    resets_at_a_time: bool,
) -> RateState:
    """What ``headers`` say of the limits ``names`` lists (kind -> the headers of its
    limit, remaining and reset), resets read as times (``resets_at_a_time``) or as
    durations."""
    found = lower(headers)
    windows = {}
    for kind, (limit, remaining, reset) in names.items():
        text = found.get(reset)
        window = Window(
            count(found.get(limit)),
            count(found.get(remaining)),
            until(text, now) if resets_at_a_time else go_duration(text),
        )
        if window != Window():
            windows[kind] = window
    return RateState(windows, retry_after(found, now))


def retry_after_of(exc: BaseException, now: datetime | None = None) -> float | None:
    """The seconds a provider's refusal says to wait (its response's ``retry-after``),
    read from an SDK error that carries the response; None where it says nothing
    readable."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    if not isinstance(headers, Mapping):
        return None
    wait = retry_after(lower(headers), now or datetime.now(UTC))
    return None if wait is None else wait.total_seconds()


def seen_of(state: RateState, now: datetime, refused: bool) -> RateSeen | None:
    """What ``state`` (an answer's, read at ``now``) tells the ledger's windows: what
    remains of each limit it names, and for a refusal (``refused``: a 429) its wait;
    None where it tells nothing."""
    remaining = {kind: w.remaining for kind, w in state.windows.items() if w.remaining is not None}
    limits = {
        f"{kind}_limit": w.limit
        for kind, w in state.windows.items()
        if w.limit  # 0: no limit
    }
    wait = state.retry_after if refused else None
    if not remaining and not limits and wait is None:
        return None
    wait_ms = 0 if wait is None else math.ceil(wait.total_seconds() * 1000)
    at_ms = math.floor(now.timestamp() * 1000)
    return RateSeen(at_ms, wait_ms=wait_ms, **remaining, **limits)
