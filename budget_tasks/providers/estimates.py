"""Upper-bound estimates from the very parameters a call will send."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import EstimateRefused
from ..pricing import Estimate, PriceTable, default_prices


def _texts(content: Any) -> Iterable[str]:
    if content is None:
        return
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                yield part
            elif isinstance(part, Mapping):
                # Non-text parts (images, files) have no byte bound here: refuse them
                # rather than under-estimate.
                if "text" not in part:
                    raise ValueError(
                        f"cannot bound a {part.get('type', 'non-text')!r} content part; "
                        "give an explicit estimate"
                    )
                yield str(part["text"])
    else:
        yield str(content)


def _message_texts(messages: Iterable[Any]) -> list[str]:
    return ["".join(_texts(m.get("content") if isinstance(m, Mapping) else m)) for m in messages]


def _model(params: Mapping[str, Any]) -> str:
    if "model" not in params:
        raise EstimateRefused("the request names no model: nothing to price it by")
    return params["model"]  # type: ignore[no-any-return]


def openai_chat(params: Mapping[str, Any], prices: PriceTable | None = None) -> Estimate:
    """Estimate ``chat.completions.create(**params)``."""
    limit = params.get("max_completion_tokens", params.get("max_tokens"))
    return (prices or default_prices()).estimate(
        _model(params), _message_texts(params.get("messages", [])), limit
    )


def openai_response(params: Mapping[str, Any], prices: PriceTable | None = None) -> Estimate:
    """Estimate ``responses.create(**params)``."""
    raw = params.get("input", "")
    texts = [raw] if isinstance(raw, str) else _message_texts(raw)
    if params.get("instructions"):
        texts.append(str(params["instructions"]))
    return (prices or default_prices()).estimate(
        _model(params), texts, params.get("max_output_tokens")
    )


def anthropic_message(params: Mapping[str, Any], prices: PriceTable | None = None) -> Estimate:
    """Estimate ``messages.create(**params)`` (the system prompt included)."""
    texts = _message_texts(params.get("messages", []))
    if params.get("system"):
        texts.append("".join(_texts(params["system"])))
    return (prices or default_prices()).estimate(_model(params), texts, params.get("max_tokens"))
