"""Upper-bound estimates from the very parameters a call will send.

Every input the provider bills is counted (its UTF-8 bytes bound its tokens: no
tokenizer emits more tokens than bytes): message texts, the system prompt, tool and
function definitions, structured-output schemas, tool calls and results carried in the
conversation. Output is bounded by the request's limit, times ``n`` choices. A field
that may bill and that these estimators cannot bound (images without ``image_tokens``,
audio, files, built-in tools, a stored prompt or an earlier response's context) is
refused with :class:`~budget_tasks.errors.EstimateRefused` naming it, never estimated
low. So is any field they do not know: a new API parameter may bill.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import EstimateRefused
from ..pricing import Estimate, PriceTable, default_prices

#: Tokens a provider may add when tools are given: the tool-use system prompt it
#: inserts (Anthropic documents up to a few hundred) and the format around each tool.
TOOLS_OVERHEAD_TOKENS = 1_000

#: Request fields that bill nothing by themselves (sampling, streaming, bookkeeping).
_OPENAI_CHAT_PLAIN = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "n", "temperature",
        "top_p", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
        "top_logprobs", "seed", "user", "metadata", "store", "stream", "stream_options",
        "parallel_tool_calls", "reasoning_effort", "service_tier", "safety_identifier",
        "prompt_cache_key", "verbosity", "modalities", "extra_headers", "extra_query",
        "timeout",
    }
)  # fmt: skip
_OPENAI_CHAT_COUNTED = frozenset(
    {"tools", "tool_choice", "functions", "function_call", "response_format", "prediction"}
)
_OPENAI_RESPONSES_PLAIN = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "parallel_tool_calls",
        "reasoning", "store", "metadata", "background", "stream", "temperature", "top_p",
        "user", "truncation", "include", "service_tier", "safety_identifier",
        "prompt_cache_key", "max_tool_calls", "top_logprobs", "extra_headers",
        "extra_query", "timeout",
    }
)  # fmt: skip
_OPENAI_RESPONSES_COUNTED = frozenset({"tools", "tool_choice", "text"})
_ANTHROPIC_PLAIN = frozenset(
    {
        "model", "messages", "max_tokens", "temperature", "top_p", "top_k",
        "stop_sequences", "metadata", "stream", "thinking", "service_tier",
        "extra_headers", "extra_query", "timeout",
    }
)  # fmt: skip
_ANTHROPIC_COUNTED = frozenset({"system", "tools", "tool_choice"})

#: Why a field is refused when these estimators meet it.
_UNBOUNDED = {
    "audio": "audio output is billed by its own rates",
    "web_search_options": "web searches are billed per search",
    "previous_response_id": "the earlier response's context is billed as input, unseen here",
    "conversation": "the conversation's items are billed as input, unseen here",
    "prompt": "a stored prompt's content is billed as input, unseen here",
    "extra_body": "its fields reach the provider unseen by the estimate",
    "mcp_servers": "MCP tool calls bill what the servers return",
    "container": "code execution is billed by the container",
}
_EXPENSIVE_TIERS = frozenset({"priority", "scale"})


def _refuse(field: str, why: str) -> EstimateRefused:
    return EstimateRefused(
        f"cannot bound the cost of field {field!r}: {why}; drop it or give an explicit estimate"
    )


def _check_fields(
    params: Mapping[str, Any], plain: frozenset[str], counted: frozenset[str]
) -> None:
    for name, value in params.items():
        if name in _UNBOUNDED and value not in (None, {}, []):
            raise _refuse(name, _UNBOUNDED[name])
        if name not in plain and name not in counted:
            raise _refuse(name, "the estimator does not know what it bills")
    if params.get("service_tier") in _EXPENSIVE_TIERS:
        raise _refuse(
            "service_tier", f"the {params['service_tier']!r} tier is priced above the table"
        )
    if "audio" in (params.get("modalities") or ()):
        raise _refuse("modalities", _UNBOUNDED["audio"])


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


class _Parts:
    """Texts found in a request, and the images that need a per-image bound."""

    def __init__(self, image_tokens: int | None) -> None:
        self.texts: list[str] = []
        self.images = 0
        self.image_tokens = image_tokens

    def content(self, content: Any, field: str) -> str:
        """The text of one message's content (str, or a list of parts)."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            return str(content)
        out: list[str] = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping):
                out.append(self.part(part, field))
            else:
                out.append(str(part))
        return "".join(out)

    def part(self, part: Mapping[str, Any], field: str) -> str:
        kind = part.get("type", "text")
        if kind in ("text", "input_text", "output_text", "refusal"):
            return str(part.get("text", part.get("refusal", "")))
        if kind in ("image_url", "input_image", "image"):
            if self.image_tokens is None:
                raise _refuse(
                    f"{field}[].{kind}",
                    "an image is billed by its size; pass image_tokens= (the most tokens one "
                    "image may cost on this model)",
                )
            self.images += 1
            return ""
        if kind in ("tool_use", "tool_result", "function_call", "function_call_output"):
            return _json_text(part)  # the call or the result travels as tokens
        raise _refuse(f"{field}[].{kind}", "the estimator cannot bound this content type")

    def messages(self, messages: Iterable[Any], field: str = "messages") -> None:
        for message in messages:
            if not isinstance(message, Mapping):
                self.texts.append(str(message))
                continue
            text = self.content(message.get("content"), field)
            extras = {
                k: message[k]
                for k in ("tool_calls", "function_call", "name", "tool_call_id")
                if message.get(k)
            }
            if extras:
                text += _json_text(extras)
            if message.get("type") in ("function_call", "function_call_output"):
                text += _json_text(message)
            self.texts.append(text)

    @property
    def extra_tokens(self) -> int:
        return self.images * (self.image_tokens or 0)


def _model(params: Mapping[str, Any]) -> str:
    if "model" not in params:
        raise EstimateRefused("the request names no model: nothing to price it by")
    return params["model"]  # type: ignore[no-any-return]


def _choices(params: Mapping[str, Any]) -> int:
    n = params.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise EstimateRefused(f"n must be a positive int of choices, not {n!r}")
    return n


def _function_tools(tools: Any, field: str, custom: tuple[str, ...]) -> str:
    """Tool definitions as the text they are billed as; built-in tools (billed per use
    or by what they fetch) are refused."""
    if not tools:
        return ""
    for tool in tools:
        kind = tool.get("type", "custom") if isinstance(tool, Mapping) else None
        if kind not in custom:
            raise _refuse(f"{field}[].type={kind!r}", "a built-in tool bills per use")
    return _json_text(tools)


def openai_chat(
    params: Mapping[str, Any], prices: PriceTable | None = None, *, image_tokens: int | None = None
) -> Estimate:
    """Estimate ``chat.completions.create(**params)``: messages, tools, functions and
    the response format as input; the output limit times ``n``."""
    _check_fields(params, _OPENAI_CHAT_PLAIN, _OPENAI_CHAT_COUNTED)
    parts = _Parts(image_tokens)
    parts.messages(params.get("messages", []))
    extra = parts.extra_tokens
    tools = _function_tools(params.get("tools"), "tools", ("function", "custom"))
    for name in ("functions", "function_call", "tool_choice", "response_format"):
        if params.get(name) is not None:
            tools += _json_text(params[name])
    if tools:
        parts.texts.append(tools)
        extra += TOOLS_OVERHEAD_TOKENS
    limit = params.get("max_completion_tokens", params.get("max_tokens"))
    prediction = params.get("prediction")
    extra_output = 0
    if prediction:
        # Predicted tokens the model rejects are billed as output.
        extra_output = len(parts.content(prediction.get("content"), "prediction").encode())
    return (prices or default_prices()).estimate(
        _model(params),
        parts.texts,
        limit,
        choices=_choices(params),
        extra_input_tokens=extra,
        extra_output_tokens=extra_output,
    )


def openai_response(
    params: Mapping[str, Any], prices: PriceTable | None = None, *, image_tokens: int | None = None
) -> Estimate:
    """Estimate ``responses.create(**params)``: input items, instructions, function
    tools and the text format as input; ``max_output_tokens`` as output."""
    _check_fields(params, _OPENAI_RESPONSES_PLAIN, _OPENAI_RESPONSES_COUNTED)
    parts = _Parts(image_tokens)
    raw = params.get("input", "")
    if isinstance(raw, str):
        parts.texts.append(raw)
    else:
        parts.messages(raw, "input")
    if params.get("instructions"):
        parts.texts.append(str(params["instructions"]))
    extra = parts.extra_tokens
    tools = _function_tools(params.get("tools"), "tools", ("function", "custom"))
    for name in ("tool_choice", "text"):
        if params.get(name) is not None:
            tools += _json_text(params[name])
    if tools:
        parts.texts.append(tools)
        extra += TOOLS_OVERHEAD_TOKENS
    return (prices or default_prices()).estimate(
        _model(params), parts.texts, params.get("max_output_tokens"), extra_input_tokens=extra
    )


def anthropic_message(
    params: Mapping[str, Any], prices: PriceTable | None = None, *, image_tokens: int | None = None
) -> Estimate:
    """Estimate ``messages.create(**params)``: messages (tool uses and results
    included), the system prompt and client tools as input; ``max_tokens`` as output
    (extended thinking is part of it)."""
    _check_fields(params, _ANTHROPIC_PLAIN, _ANTHROPIC_COUNTED)
    parts = _Parts(image_tokens)
    parts.messages(params.get("messages", []))
    if params.get("system"):
        parts.texts.append(parts.content(params["system"], "system"))
    extra = parts.extra_tokens
    tools = _function_tools(params.get("tools"), "tools", ("custom",))
    if params.get("tool_choice") is not None:
        tools += _json_text(params["tool_choice"])
    if tools:
        parts.texts.append(tools)
        extra += TOOLS_OVERHEAD_TOKENS
    return (prices or default_prices()).estimate(
        _model(params), parts.texts, params.get("max_tokens"), extra_input_tokens=extra
    )
