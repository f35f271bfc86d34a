"""What OpenAI's answers say was used, read from their JSON or the SDK's objects: the
snapshot model that answered, the service tier that billed it, and every usage field
the SDK's usage types carry (see ``USAGE_FIELDS``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...pricing import Usage
from ...pricing.usage import STANDARD, PriceContext
from ..base import Part, Reported, count_of, field_of, usage_object

#: Every leaf of the SDK's usage types, and how it is priced or why it needs no price
#: of its own. tests/integration/test_sdk_specification.py walks the installed SDK's
#: types against this list: a new field fails the suite until it is reviewed here.
USAGE_FIELDS = {
    # CompletionUsage (chat completions, legacy completions)
    "CompletionUsage.prompt_tokens": "priced: all input, at the input rate less its parts",
    "CompletionUsage.prompt_tokens_details.cached_tokens": "priced: cache reads",
    "CompletionUsage.prompt_tokens_details.cache_write_tokens": "priced: cache writes",
    "CompletionUsage.prompt_tokens_details.audio_tokens": "priced: audio input",
    "CompletionUsage.prompt_tokens_details.image_tokens": "priced: image input",
    "CompletionUsage.prompt_tokens_details.text_tokens": "reviewed: the text part of prompt_tokens, at the input rate",
    "CompletionUsage.completion_tokens": "priced: all output",
    "CompletionUsage.completion_tokens_details.reasoning_tokens": "priced: part of the output, at the output rate",
    "CompletionUsage.completion_tokens_details.audio_tokens": "priced: audio output",
    "CompletionUsage.completion_tokens_details.text_tokens": "reviewed: the text part of completion_tokens",
    "CompletionUsage.completion_tokens_details.accepted_prediction_tokens": "reviewed: part of completion_tokens",
    "CompletionUsage.completion_tokens_details.rejected_prediction_tokens": "reviewed: billed as completion tokens and counted in completion_tokens",
    "CompletionUsage.total_tokens": "reviewed: the sum of prompt and completion tokens",
    # ResponseUsage (Responses)
    "ResponseUsage.input_tokens": "priced: all input, at the input rate less its parts",
    "ResponseUsage.input_tokens_details.cached_tokens": "priced: cache reads",
    "ResponseUsage.input_tokens_details.cache_write_tokens": "priced: cache writes",
    "ResponseUsage.input_tokens_details.cache_write_tokens_details.ttl_30m_tokens": "reviewed: part of cache_write_tokens, at the cache-write rate (no TTL rates are published apart)",
    "ResponseUsage.input_tokens_details.cache_write_tokens_details.ttl_12h_tokens": "reviewed: part of cache_write_tokens, at the cache-write rate (no TTL rates are published apart)",
    "ResponseUsage.output_tokens": "priced: all output",
    "ResponseUsage.output_tokens_details.reasoning_tokens": "priced: part of the output, at the output rate",
    "ResponseUsage.total_tokens": "reviewed: the sum of input and output tokens",
    # embeddings
    "EmbeddingUsage.prompt_tokens": "priced: all input",
    "EmbeddingUsage.total_tokens": "reviewed: equal to prompt_tokens",
    # images (GPT image models)
    "ImageUsage.input_tokens": "priced: all input",
    "ImageUsage.input_tokens_details.text_tokens": "reviewed: the text part of input_tokens",
    "ImageUsage.input_tokens_details.image_tokens": "priced: image input",
    "ImageUsage.output_tokens": "priced: all output",
    "ImageUsage.output_tokens_details.image_tokens": "priced: image output",
    "ImageUsage.output_tokens_details.text_tokens": "reviewed: the text part of output_tokens",
    "ImageUsage.total_tokens": "reviewed: the sum of input and output tokens",
    "SvgUsage.model": "priced: SVG authoring is priced at this model",
    "SvgUsage.input_tokens": "priced: input of the SVG author",
    "SvgUsage.output_tokens": "priced: output of the SVG author",
    "SvgUsage.reasoning_tokens": "priced: part of the SVG author's output",
    "SvgUsage.total_tokens": "reviewed: the sum of its input and output tokens",
}


def tokens(usage: Any, inputs: str = "prompt", outputs: str = "completion") -> Usage:
    """An OpenAI usage object (chat: ``prompt``/``completion``; Responses and images:
    ``input``/``output``) as one :class:`Usage`: cached reads and cache writes are
    inside the input total, reasoning and audio inside the output total."""
    usage = usage_object(usage, needs=(f"{inputs}_tokens", f"{outputs}_tokens"))
    details = usage_object(field_of(usage, f"{inputs}_tokens_details"))
    out_details = usage_object(field_of(usage, f"{outputs}_tokens_details"))

    def count(obj: Any, name: str) -> int:
        return count_of(field_of(obj, name), name)

    cached = count(details, "cached_tokens")
    written = count(details, "cache_write_tokens")
    # a total below its parts is read as the parts: the dearer reading
    total_in = max(count(usage, f"{inputs}_tokens"), cached + written)
    plain = total_in - cached - written
    audio_in = min(plain, count(details, "audio_tokens"))
    image_in = min(plain - audio_in, count(details, "image_tokens"))
    reasoning = count(out_details, "reasoning_tokens")
    output = max(count(usage, f"{outputs}_tokens"), reasoning)
    audio_out = min(output - reasoning, count(out_details, "audio_tokens"))
    image_out = min(output - reasoning - audio_out, count(out_details, "image_tokens"))
    return Usage(
        input_tokens=plain,
        cached_input_tokens=cached,
        cache_write_tokens=written,
        output_tokens=output,
        reasoning_tokens=reasoning,
        input_audio_tokens=audio_in,
        input_image_tokens=image_in,
        output_audio_tokens=audio_out,
        output_image_tokens=image_out,
    )


def _context(answer: Any) -> PriceContext:
    tier = field_of(answer, "service_tier")
    return PriceContext(service_tier=tier) if isinstance(tier, str) and tier else STANDARD


def _asked(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) and model else None


def _model(answer: Any, body: Mapping[str, Any]) -> str:
    model = field_of(answer, "model")
    return model if isinstance(model, str) and model else str(body.get("model") or "")


def chat(answer: Any, body: Mapping[str, Any]) -> Reported | None:
    """A chat completion (or legacy completion): its usage, snapshot and tier."""
    usage = field_of(answer, "usage")
    if not usage:
        return None
    part = Part(_model(answer, body), tokens(usage), _context(answer), _asked(body))
    return Reported((part,), field_of(answer, "id"))


def chat_stream(events: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> Reported | None:
    """A streamed chat completion: the usage of its last chunk (asked for with
    ``stream_options.include_usage``)."""
    usage = model = tier = response_id = None
    for event in events:
        response_id = event.get("id") or response_id
        model = event.get("model") or model
        tier = event.get("service_tier") or tier
        usage = event.get("usage") or usage
    if not usage:
        return None
    answer = {"model": model, "service_tier": tier, "usage": usage, "id": response_id}
    return chat(answer, body)


def _web_searches(answer: Any) -> int:
    output = field_of(answer, "output") or []
    return sum(1 for item in output if field_of(item, "type") == "web_search_call")


def response(answer: Any, body: Mapping[str, Any]) -> Reported | None:
    """A Response: its usage (None while it runs in the background), and the web
    searches its built-in tool made."""
    usage = field_of(answer, "usage")
    if not usage:
        return None
    used = tokens(usage, "input", "output")
    searches = _web_searches(answer)
    if searches:
        used = used + Usage(web_searches=searches)
    part = Part(_model(answer, body), used, _context(answer), _asked(body))
    return Reported((part,), field_of(answer, "id"))


def response_stream(
    events: Sequence[Mapping[str, Any]], body: Mapping[str, Any]
) -> Reported | None:
    """A streamed Response: the response its ``response.completed`` event carries."""
    final = None
    for event in events:
        if isinstance(event.get("response"), Mapping):
            final = event["response"]
    return None if final is None else response(final, body)


def embeddings(answer: Any, body: Mapping[str, Any]) -> Reported | None:
    usage = field_of(answer, "usage")
    if not usage:
        return None
    usage = usage_object(usage, needs=("prompt_tokens",))
    used = Usage(input_tokens=count_of(field_of(usage, "prompt_tokens"), "prompt_tokens"))
    return Reported((Part(_model(answer, body), used, asked=_asked(body)),), None)


def images(answer: Any, body: Mapping[str, Any]) -> Reported | None:
    """An image generation: its token usage at the requested model, and an SVG
    author's usage at the SVG author's model."""
    usage = field_of(answer, "usage")
    if not usage:
        return None
    parts = [Part(str(body.get("model") or ""), tokens(usage, "input", "output"))]
    svg = usage_object(field_of(answer, "svg_usage"), "svg_usage")
    if svg:
        reasoning = count_of(field_of(svg, "reasoning_tokens"), "reasoning_tokens")
        output = max(count_of(field_of(svg, "output_tokens"), "output_tokens"), reasoning)
        parts.append(
            Part(
                str(field_of(svg, "model") or ""),
                Usage(
                    input_tokens=count_of(field_of(svg, "input_tokens"), "input_tokens"),
                    output_tokens=output,
                    reasoning_tokens=reasoning,
                ),
            )
        )
    return Reported(tuple(parts), None)


def speech(answer: Any, body: Mapping[str, Any]) -> Reported:
    """A speech answer is audio with no usage: a per-character model bills the input's
    characters, known from the request."""
    text = body.get("input")
    used = Usage(input_characters=len(text) if isinstance(text, str) else 0)
    return Reported((Part(str(body.get("model") or ""), used),), None)
