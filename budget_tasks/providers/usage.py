"""Usage objects from the SDKs (or their JSON) into one :class:`~budget_tasks.pricing.Usage`."""

from __future__ import annotations

from typing import Any

from ..pricing import Usage


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def from_openai_chat(usage: Any) -> Usage:
    """Chat completions: ``prompt_tokens`` includes cached tokens and
    ``completion_tokens`` includes reasoning tokens."""
    cached = _int(_get(_get(usage, "prompt_tokens_details"), "cached_tokens"))
    prompt = _int(_get(usage, "prompt_tokens"))
    output = _int(_get(usage, "completion_tokens"))
    return Usage(
        input_tokens=max(0, prompt - cached),
        cached_input_tokens=min(cached, prompt),
        output_tokens=output,
        reasoning_tokens=min(
            output, _int(_get(_get(usage, "completion_tokens_details"), "reasoning_tokens"))
        ),
    )


def from_openai_response(usage: Any) -> Usage:
    """Responses API: ``input_tokens`` includes cached, ``output_tokens`` reasoning."""
    cached = _int(_get(_get(usage, "input_tokens_details"), "cached_tokens"))
    total_in = _int(_get(usage, "input_tokens"))
    output = _int(_get(usage, "output_tokens"))
    return Usage(
        input_tokens=max(0, total_in - cached),
        cached_input_tokens=min(cached, total_in),
        output_tokens=output,
        reasoning_tokens=min(
            output, _int(_get(_get(usage, "output_tokens_details"), "reasoning_tokens"))
        ),
    )


def from_anthropic(usage: Any) -> Usage:
    """Anthropic: ``input_tokens`` excludes cache reads and cache writes."""
    return Usage(
        input_tokens=_int(_get(usage, "input_tokens")),
        cached_input_tokens=_int(_get(usage, "cache_read_input_tokens")),
        cache_write_tokens=_int(_get(usage, "cache_creation_input_tokens")),
        output_tokens=_int(_get(usage, "output_tokens")),
    )
