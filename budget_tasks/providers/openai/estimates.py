"""Upper bounds for OpenAI's billable endpoints, from the very body a call sends (see
:mod:`budget_tasks.providers.bounds` for what is counted and what is refused).

Service tiers: a request that names ``flex``, ``default`` or ``priority`` is priced at
that tier; one that leaves it to the project (``auto``, or none) may be billed at the
project's default tier, which may be priority: it is priced at the dearest of
``AUTO_TIERS`` unless you declare the project's tier (``OpenAI(project_tier=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import EstimateRefused
from ...pricing import Estimate, Prices, default_prices
from ...pricing.usage import STANDARD, PriceContext
from ..bounds import (
    Parts,
    check_fields,
    choices,
    fields_text,
    function_tools,
    model_of,
    refuse,
)

PROVIDER = "openai"
#: The tiers a request that leaves the tier to the project may be billed at.
AUTO_TIERS = ("default", "priority")

#: Request fields that bill nothing by themselves (sampling, streaming, bookkeeping).
_CHAT_PLAIN = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "n", "temperature",
        "top_p", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
        "top_logprobs", "seed", "user", "metadata", "store", "stream", "stream_options",
        "parallel_tool_calls", "reasoning_effort", "service_tier", "safety_identifier",
        "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "verbosity",
        "modalities", "extra_headers", "extra_query", "timeout",
    }
)  # fmt: skip
_CHAT_COUNTED = frozenset(
    {"tools", "tool_choice", "functions", "function_call", "response_format", "prediction"}
)
_RESPONSES_PLAIN = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "parallel_tool_calls",
        "reasoning", "store", "metadata", "background", "stream", "stream_options",
        "temperature", "top_p", "user", "truncation", "include", "service_tier",
        "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
        "prompt_cache_options", "max_tool_calls", "top_logprobs", "extra_headers",
        "extra_query", "timeout",
    }
)  # fmt: skip
_RESPONSES_COUNTED = frozenset({"tools", "tool_choice", "text"})
#: Fields that may bill what the estimate cannot see, and why.
REFUSED = {
    "audio": "audio output is billed by its own rates",
    "web_search_options": "web searches are billed per search",
    "previous_response_id": "the earlier response's context is billed as input, unseen here",
    "conversation": "the conversation's items are billed as input, unseen here",
    "prompt": "a stored prompt's content is billed as input, unseen here",
    "extra_body": "its fields reach the provider unseen by the estimate",
    "moderation": "moderating the input and output may bill apart, at no rate known here",
    "context_management": "compaction runs the model on context the estimate cannot see",
    "access_programs": "an access program may carry its own prices",
    "background_options": "a longer completion window may carry its own prices",
    "image": "request-level image options bill image generation",
}
#: What every endpoint refuses: fields that reach the provider unseen by the estimate.
COMMON_REFUSED = {"extra_body": REFUSED["extra_body"]}
_EXPENSIVE_TIERS = frozenset({"priority", "scale"})


def tiers(params: Mapping[str, Any], auto: Sequence[str] = AUTO_TIERS) -> list[PriceContext]:
    """The price contexts a request may be billed in (see the module)."""
    tier = params.get("service_tier")
    if tier in (None, "auto"):
        return [PriceContext(service_tier=t) for t in auto] or [STANDARD]
    if not isinstance(tier, str):
        raise EstimateRefused(f"service_tier must be a string, not {tier!r}")
    return [PriceContext(service_tier="priority" if tier in _EXPENSIVE_TIERS else tier)]


def _check_media_modalities(params: Mapping[str, Any]) -> None:
    if "audio" in (params.get("modalities") or ()):
        raise refuse("modalities", REFUSED["audio"])


def chat(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
    auto_tiers: Sequence[str] = AUTO_TIERS,
) -> Estimate:
    """Estimate ``chat.completions.create(**params)``: messages, tools, functions and
    the response format as input; the output limit times ``n``."""
    check_fields(params, _CHAT_PLAIN, _CHAT_COUNTED, REFUSED)
    _check_media_modalities(params)
    parts = Parts(image_tokens)
    parts.messages(params.get("messages") or [])
    tools = function_tools(params.get("tools"), "tools", ("function", "custom"))
    parts.definitions(
        tools
        + fields_text(params, ("functions", "function_call", "tool_choice", "response_format"))
    )
    limit = params.get("max_completion_tokens", params.get("max_tokens"))
    prediction = params.get("prediction")
    extra_output = 0
    if prediction:
        # Predicted tokens the model rejects are billed as output.
        content = prediction.get("content") if isinstance(prediction, Mapping) else prediction
        extra_output = len(parts.content(content, "prediction").encode())
    return _at_tiers(
        params,
        prices,
        parts,
        limit,
        auto_tiers,
        provider,
        choices=choices(params),
        extra_output_tokens=extra_output,
    )


def response(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
    auto_tiers: Sequence[str] = AUTO_TIERS,
) -> Estimate:
    """Estimate ``responses.create(**params)``: every input item (messages, tool calls
    and their outputs, reasoning items, media inside them), instructions, function tools
    and the text format as input; ``max_output_tokens`` as output."""
    check_fields(params, _RESPONSES_PLAIN, _RESPONSES_COUNTED, REFUSED)
    parts = Parts(image_tokens)
    raw = params.get("input", "")
    if isinstance(raw, str):
        parts.add(raw)
    elif isinstance(raw, list | tuple):
        parts.messages(raw, "input")
    else:
        raise EstimateRefused(
            f"input must be a string or a list of items, not {type(raw).__name__}"
        )
    if params.get("instructions"):
        parts.add(str(params["instructions"]))
    tools = function_tools(params.get("tools"), "tools", ("function", "custom"))
    parts.definitions(tools + fields_text(params, ("tool_choice", "text")))
    return _at_tiers(params, prices, parts, params.get("max_output_tokens"), auto_tiers, provider)


def _at_tiers(
    params: Mapping[str, Any],
    prices: Prices | None,
    parts: Parts,
    limit: Any,
    auto_tiers: Sequence[str],
    provider: str | None,
    **more: Any,
) -> Estimate:
    """The bound at the dearest tier the request may be billed at."""
    model = model_of(params)
    table = prices or default_prices()
    return max(
        (
            table.estimate(
                model,
                parts.texts,
                limit,
                extra_input_tokens=parts.extra_tokens,
                provider=provider,
                context=context,
                images=parts.media > 0,
                **more,
            )
            for context in tiers(params, auto_tiers)
        ),
        key=lambda e: e.amount,
    )


_EMBEDDINGS_PLAIN = frozenset(
    {
        "model",
        "input",
        "dimensions",
        "encoding_format",
        "user",
        "extra_headers",
        "extra_query",
        "timeout",
    }
)


def _token_input(value: Any, field: str) -> tuple[list[str], int]:
    """Texts, and token counts of token-id arrays, of an embeddings or completions input."""
    if isinstance(value, str):
        return [value], 0
    if isinstance(value, list | tuple):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [], len(value)  # one prompt as token ids: exactly that many tokens
        texts: list[str] = []
        tokens = 0
        for item in value:
            more_texts, more_tokens = _token_input(item, field)
            texts += more_texts
            tokens += more_tokens
        return texts, tokens
    raise EstimateRefused(f"{field} must be text, texts or token ids, not {type(value).__name__}")


def embeddings(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
) -> Estimate:
    """Estimate ``embeddings.create(**params)``: every input as input tokens, no output."""
    check_fields(params, _EMBEDDINGS_PLAIN, frozenset(), COMMON_REFUSED)
    texts, tokens = _token_input(params.get("input"), "input")
    table = prices or default_prices()
    rates = table.rates(model_of(params), provider=provider)
    estimate = table.estimate(
        model_of(params), texts, 1, extra_input_tokens=tokens, provider=provider
    )
    # no output is billed: take the one output token the bound needs back off
    amount = -(-(estimate.input_tokens * rates.dearest_input(cache=None)) // 1_000_000)
    return Estimate(amount, estimate.model, estimate.input_tokens, 0, estimate.price_version)


_COMPLETIONS_PLAIN = frozenset(
    {
        "model", "prompt", "max_tokens", "n", "best_of", "echo", "frequency_penalty",
        "logit_bias", "logprobs", "presence_penalty", "seed", "stop", "stream",
        "stream_options", "suffix", "temperature", "top_p", "user", "extra_headers",
        "extra_query", "timeout",
    }
)  # fmt: skip
#: The legacy completions API's own default output limit.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completions(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
) -> Estimate:
    """Estimate the legacy ``completions.create(**params)``: each prompt (texts or token
    ids) and the suffix as input; ``max_tokens`` (16 when not given, as the API does)
    for each of ``max(n, best_of)`` completions the provider generates, for each
    prompt."""
    check_fields(params, _COMPLETIONS_PLAIN, frozenset(), COMMON_REFUSED)
    prompts = _prompts(params.get("prompt", "<|endoftext|>"))
    texts = [p for p in prompts if isinstance(p, str)]
    tokens = sum(len(p) for p in prompts if isinstance(p, list))
    if params.get("suffix"):
        texts.append(str(params["suffix"]))
    limit = params.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    generated = max(choices(params), choices(params, "best_of"))
    return (prices or default_prices()).estimate(
        model_of(params),
        texts,
        limit,
        choices=generated * len(prompts),
        extra_input_tokens=tokens,
        provider=provider,
    )


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A legacy completion's prompts, each completed apart: one text, texts, one prompt
    as token ids, or prompts as token ids."""

    def ids(value: Any) -> bool:
        return isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )

    if isinstance(prompt, str) or ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return list(prompt)
    raise EstimateRefused("prompt must be text, texts, token ids or lists of them")


_IMAGES_PLAIN = frozenset(
    {
        "model", "prompt", "n", "quality", "size", "background", "output_format",
        "output_compression", "response_format", "user", "safety_identifier", "moderation",
        "style", "extra_headers", "extra_query", "timeout",
    }
)  # fmt: skip
_IMAGES_REFUSED = {
    **COMMON_REFUSED,
    "partial_images": "each partial image bills output tokens of its own",
    "stream": "a streamed generation bills its partial images",
    "svg": "SVG authoring bills another model's tokens",
    "complexity": "planning computation bills apart from rendering",
    "frame_count": "animated output bills per frame",
    "frame_duration_ms": "animated output bills per frame",
}
#: Output tokens of one image from the GPT image models, by size and quality (OpenAI's
#: published table); "auto" is the dearest.
IMAGE_OUTPUT_TOKENS = {
    "1024x1024": {"low": 272, "medium": 1056, "high": 4160},
    "1024x1536": {"low": 408, "medium": 1584, "high": 6240},
    "1536x1024": {"low": 400, "medium": 1568, "high": 6208},
}
IMAGE_MODELS = ("gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5")


def image_tokens_for(size: Any, quality: Any) -> int:
    """The most output tokens one image of ``size`` and ``quality`` may cost."""
    sizes = list(IMAGE_OUTPUT_TOKENS) if size in (None, "auto") else [size]
    qualities = ["low", "medium", "high"] if quality in (None, "auto") else [quality]
    found = []
    for s in sizes:
        for q in qualities:
            if s not in IMAGE_OUTPUT_TOKENS or q not in IMAGE_OUTPUT_TOKENS[s]:
                raise refuse(
                    "size" if s not in IMAGE_OUTPUT_TOKENS else "quality",
                    f"no published token count for a {s} image at {q} quality",
                )
            found.append(IMAGE_OUTPUT_TOKENS[s][q])
    return max(found)


def images(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
) -> Estimate:
    """Estimate ``images.generate(**params)`` with a GPT image model: the prompt as text
    input, each of ``n`` images at the most output tokens its size and quality may cost."""
    check_fields(params, _IMAGES_PLAIN, frozenset(), _IMAGES_REFUSED)
    model = model_of(params)
    if not model.startswith(IMAGE_MODELS):
        raise refuse("model", f"{model!r} is not a GPT image model priced by the token")
    if params.get("output_format") in ("svg", "gif"):
        raise refuse("output_format", _IMAGES_REFUSED["svg"])
    per_image = image_tokens_for(params.get("size"), params.get("quality"))
    return (prices or default_prices()).estimate(
        model,
        [str(params.get("prompt") or "")],
        per_image,
        choices=choices(params),
        provider=provider,
        cache=None,
    )


_SPEECH_PLAIN = frozenset(
    {
        "model",
        "input",
        "voice",
        "response_format",
        "speed",
        "extra_headers",
        "extra_query",
        "timeout",
    }
)
_SPEECH_REFUSED = {
    **COMMON_REFUSED,
    "instructions": (
        "instructions steer a token-priced voice model whose audio output is not bounded"
    ),
    "stream_format": "a streamed speech answer is not metered yet",
}


def speech(
    params: Mapping[str, Any],
    prices: Prices | None = None,
    *,
    image_tokens: int | None = None,
    provider: str | None = PROVIDER,
) -> Estimate:
    """Estimate ``audio.speech.create(**params)`` for a model priced per character of
    its input (tts-1, tts-1-hd): exact, since the answer is audio that reports no usage.
    A model priced by audio tokens has no bound on its output: refused."""
    check_fields(params, _SPEECH_PLAIN, frozenset(), _SPEECH_REFUSED)
    model = model_of(params)
    text = params.get("input")
    if not isinstance(text, str):
        raise EstimateRefused("speech input must be text")
    table = prices or default_prices()
    rates = table.rates(model, provider=provider)
    if not rates.input_character:
        raise refuse(
            "model", f"{model!r} bills audio output tokens that the request does not bound"
        )
    characters = len(text)
    amount = -(-(characters * rates.input_character) // 1_000_000)
    return Estimate(amount, model, 0, 0, table.version)


#: Every request field each estimator has a ruling on (billing nothing, counted as
#: input, or refused): tests hold it against the installed SDK's own parameters, so a
#: new parameter fails the suite until it is reviewed here.
REVIEWED_FIELDS = {
    "chat": _CHAT_PLAIN | _CHAT_COUNTED | frozenset(REFUSED),
    "responses": _RESPONSES_PLAIN | _RESPONSES_COUNTED | frozenset(REFUSED),
    "embeddings": _EMBEDDINGS_PLAIN | frozenset(COMMON_REFUSED),
    "completions": _COMPLETIONS_PLAIN | frozenset(COMMON_REFUSED),
    "images": _IMAGES_PLAIN | frozenset(_IMAGES_REFUSED),
    "speech": _SPEECH_PLAIN | frozenset(_SPEECH_REFUSED),
}
