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


def _openai(usage: Any, inputs: str, outputs: str) -> Usage:
    # Both OpenAI APIs count cached tokens inside the input total and reasoning tokens
    # inside the output total; only the field names differ.
    total_in = _int(_get(usage, f"{inputs}_tokens"))
    cached = min(total_in, _int(_get(_get(usage, f"{inputs}_tokens_details"), "cached_tokens")))
    output = _int(_get(usage, f"{outputs}_tokens"))
    reasoning = _int(_get(_get(usage, f"{outputs}_tokens_details"), "reasoning_tokens"))
    return Usage(
        input_tokens=total_in - cached,
        cached_input_tokens=cached,
        output_tokens=output,
        reasoning_tokens=min(output, reasoning),
    )


def from_openai_chat(usage: Any) -> Usage:
    """Chat completions: ``prompt_tokens`` / ``completion_tokens``."""
    return _openai(usage, "prompt", "completion")


def from_openai_response(usage: Any) -> Usage:
    """Responses API: ``input_tokens`` / ``output_tokens``."""
    return _openai(usage, "input", "output")


def from_anthropic(usage: Any) -> Usage:
    """Anthropic: ``input_tokens`` excludes cache reads and cache writes."""
    return Usage(
        input_tokens=_int(_get(usage, "input_tokens")),
        cached_input_tokens=_int(_get(usage, "cache_read_input_tokens")),
        cache_write_tokens=_int(_get(usage, "cache_creation_input_tokens")),
        output_tokens=_int(_get(usage, "output_tokens")),
    )
