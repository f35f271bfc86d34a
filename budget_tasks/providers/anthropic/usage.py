"""What Anthropic's answers say was used: the snapshot model, the tier (a batch bills
half), the cache writes by TTL, thinking and server tools."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...pricing import Usage
from ...pricing.usage import STANDARD, PriceContext
from ..base import Part, Reported, count_of, field_of, usage_object

#: Every leaf of the SDK's usage types, and how it is priced or why it needs no price
#: of its own (checked against the installed SDK, as for OpenAI).
USAGE_FIELDS = {
    "Usage.input_tokens": "priced: uncached input",
    "Usage.cache_read_input_tokens": "priced: cache reads (0.1x input)",
    "Usage.cache_creation_input_tokens": "priced: cache writes, split by TTL below (5-minute where not split)",
    "Usage.cache_creation.ephemeral_5m_input_tokens": "reviewed: the writes that are not for 1 hour, priced as 5-minute writes (1.25x input) from the total; never fewer than this",
    "Usage.cache_creation.ephemeral_1h_input_tokens": "priced: 1-hour cache writes (2x input)",
    "Usage.output_tokens": "priced: all output, thinking included",
    "Usage.output_tokens_details.thinking_tokens": "reviewed: part of output_tokens, at the output rate",
    "Usage.server_tool_use.web_search_requests": "priced: per search",
    "Usage.server_tool_use.web_fetch_requests": "reviewed: web fetch bills only the tokens it brings in, counted in input_tokens",
    "Usage.service_tier": "priced: 'batch' bills the batch rates",
    "Usage.speed": "priced: 'fast' bills the fast-mode rates",
    "Usage.inference_geo": "reviewed: a region's own rates are not known; the estimator refuses a request that chooses one",
    "MessageDeltaUsage.input_tokens": "priced: as Usage.input_tokens (a stream's final counts)",
    "MessageDeltaUsage.cache_read_input_tokens": "priced: as Usage",
    "MessageDeltaUsage.cache_creation_input_tokens": "priced: as Usage",
    "MessageDeltaUsage.output_tokens": "priced: as Usage",
    "MessageDeltaUsage.output_tokens_details.thinking_tokens": "reviewed: part of output_tokens",
    "MessageDeltaUsage.server_tool_use.web_search_requests": "priced: as Usage",
    "MessageDeltaUsage.server_tool_use.web_fetch_requests": "reviewed: as Usage",
}


def tokens(usage: Any) -> Usage:
    """An Anthropic usage object as one :class:`Usage`: ``input_tokens`` excludes cache
    reads and writes; writes split by TTL where the answer splits them."""
    usage = usage_object(usage, needs=("input_tokens", "output_tokens"))
    split = usage_object(field_of(usage, "cache_creation"), "cache_creation")
    tools = usage_object(field_of(usage, "server_tool_use"), "server_tool_use")

    def count(obj: Any, name: str) -> int:
        return count_of(field_of(obj, name), name)

    one_hour = count(split, "ephemeral_1h_input_tokens")
    # the total and its split should agree; where they do not, the dearer reading
    written = max(
        count(usage, "cache_creation_input_tokens"),
        one_hour + count(split, "ephemeral_5m_input_tokens"),
    )
    return Usage(
        input_tokens=count(usage, "input_tokens"),
        cached_input_tokens=count(usage, "cache_read_input_tokens"),
        cache_write_tokens=written - one_hour,
        cache_write_1h_tokens=one_hour,
        output_tokens=count(usage, "output_tokens"),
        web_searches=count(tools, "web_search_requests"),
    )


def context(usage: Any, batch: bool = False) -> PriceContext:
    tier = field_of(usage, "service_tier")
    speed = field_of(usage, "speed")
    batched = batch or tier == "batch"
    if not batched and speed != "fast":
        return STANDARD
    return PriceContext(batch=batched, speed=speed if speed == "fast" else None)


def _asked(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) and model else None


def _model(answer: Any, body: Mapping[str, Any]) -> str:
    model = field_of(answer, "model")
    return model if isinstance(model, str) and model else str(body.get("model") or "")


def message(answer: Any, body: Mapping[str, Any], *, batch: bool = False) -> Reported | None:
    """A message: its usage, at its snapshot model, in the tier its usage names."""
    usage = field_of(answer, "usage")
    if not usage:
        return None
    part = Part(_model(answer, body), tokens(usage), context(usage, batch), _asked(body))
    return Reported((part,), field_of(answer, "id"))


def message_stream(events: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> Reported | None:
    """A streamed message: ``message_start`` carries the input counts, ``message_delta``
    the final (cumulative) ones. None until the final counts came (a stream left, or
    ended by an ``error`` event, before them: its output is not known, and the hold
    stays)."""
    start: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    final = False
    for event in events:
        if event.get("type") == "message_start":
            start = dict(event.get("message") or {})
            usage.update(start.get("usage") or {})
        elif event.get("type") == "message_delta":
            usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
            final = True
        elif event.get("type") == "error":
            return None
    if not start or not usage or not final:
        return None
    return message({**start, "usage": usage}, body)


def batch_created(answer: Any, body: Mapping[str, Any]) -> None:
    """A batch answers at once, before any work: its usage is read when it ends."""
    return None
