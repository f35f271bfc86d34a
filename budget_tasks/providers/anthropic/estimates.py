"""Upper bounds for Anthropic's billable endpoints (see
:mod:`budget_tasks.providers.bounds` for what is counted and what is refused).

Prompt caching: a request that asks for a cache write (a ``cache_control`` marker
anywhere, or the top-level one) may be billed its input at the cache-write rate, 1.25x
the input rate for the 5-minute cache and 2x for the 1-hour one (``"ttl": "1h"``): its
input is bounded at that rate. One that asks for none is not written to the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import EstimateRefused
from ...pricing import Estimate, Prices, default_prices
from ...pricing.usage import STANDARD, PriceContext
from ..bounds import (
    Parts,
    check_fields,
    fields_text,
    find_values,
    function_tools,
    has_key,
    model_of,
)

PROVIDER = "anthropic"

_PLAIN = frozenset(
    {
        "model", "messages", "max_tokens", "temperature", "top_p", "top_k",
        "stop_sequences", "metadata", "stream", "thinking", "service_tier", "diagnostics",
        "cache_control", "speed", "user_profile_id", "workspace_id", "extra_headers",
        "extra_query", "timeout",
    }
)  # fmt: skip
_COUNTED = frozenset({"system", "tools", "tool_choice", "output_config"})
#: Fields that may bill what the estimate cannot see, and why.
REFUSED = {
    "mcp_servers": "MCP tool calls bill what the servers return",
    "container": "code execution is billed by the container",
    "extra_body": "its fields reach the provider unseen by the estimate",
    "inference_geo": (
        "inference in a chosen region may be priced above the standard rates, at no rate known here"
    ),
}


def cache_ttl(params: Mapping[str, Any]) -> str | None:
    """The dearest cache write a request may make: None, "5m" or "1h"."""
    if not has_key(params, "cache_control"):
        return None
    ttls = [
        marker.get("ttl")
        for marker in find_values(params, "cache_control")
        if isinstance(marker, Mapping)
    ]
    return "1h" if "1h" in ttls else "5m"


def message(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
) -> Estimate:
    """Estimate ``messages.create(**params)``: messages (tool uses and results, media
    inside them included), the system prompt, client tools and the output format as
    input, at the dearest cache-write rate the request asks for; ``max_tokens`` as
    output (extended thinking is part of it)."""
    check_fields(params, _PLAIN, _COUNTED, REFUSED)
    parts = Parts(image_tokens)
    parts.messages(params.get("messages") or [])
    if params.get("system"):
        parts.add(parts.content(params["system"], "system"))
    tools = function_tools(params.get("tools"), "tools", ("custom",))
    parts.definitions(tools + fields_text(params, ("tool_choice", "output_config")))
    speed = params.get("speed")
    context = PriceContext(speed=speed) if speed == "fast" else STANDARD
    return (prices or default_prices()).estimate(
        model_of(params),
        parts.texts,
        params.get("max_tokens"),
        extra_input_tokens=parts.extra_tokens,
        provider=provider,
        context=context,
        cache=cache_ttl(params),
        images=parts.media > 0,
    )


def batch(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
) -> Estimate:
    """An Anthropic Message Batch: the sum of its requests' bounds, at full price (the
    batch discount only lowers what is billed)."""
    requests = params.get("requests")
    if not isinstance(requests, list) or not requests:
        raise EstimateRefused("a message batch without requests: nothing to bound it by")
    bounds = [
        message(
            (item or {}).get("params") or {}, prices, image_tokens=image_tokens, provider=provider
        )
        for item in requests
    ]
    return Estimate(
        amount=sum(b.amount for b in bounds),
        model=bounds[0].model,
        input_tokens=sum(b.input_tokens for b in bounds),
        output_tokens=sum(b.output_tokens for b in bounds),
        price_version=bounds[0].price_version,
    )


#: Every request field the estimator has a ruling on (see the OpenAI module's).
REVIEWED_FIELDS = {"messages": _PLAIN | _COUNTED | frozenset(REFUSED)}
