"""Usage objects from the SDKs (or their JSON) into one :class:`~budget_tasks.pricing.Usage`
(each vendor's own module reads its answers whole: model, tier, usage)."""

from __future__ import annotations

from typing import Any

from ..pricing import Usage
from .anthropic.usage import tokens as _anthropic_tokens
from .openai.usage import tokens as _openai_tokens


def from_openai_chat(usage: Any) -> Usage:
    """Chat completions: ``prompt_tokens`` / ``completion_tokens``."""
    return _openai_tokens(usage, "prompt", "completion")


def from_openai_response(usage: Any) -> Usage:
    """Responses API: ``input_tokens`` / ``output_tokens``."""
    return _openai_tokens(usage, "input", "output")


def from_anthropic(usage: Any) -> Usage:
    """Anthropic: ``input_tokens`` excludes cache reads and cache writes."""
    return _anthropic_tokens(usage)
