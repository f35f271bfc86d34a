"""Guarded billable calls through the official SDKs.

Each call refuses a client whose SDK retries are on, sends the attempt key as the
``Idempotency-Key`` header, hands the provider's request id to ``on_request_id`` as
soon as the response headers arrive (before the body, for streams too), reads the
usage and prices it. Errors are the SDKs' own; :func:`classify` says what they mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _validate as check
from ..errors import StreamIncomplete
from ..pricing import PriceTable, Usage, default_prices
from . import usage as usage_of
from .clients import client_timeout, require_no_retries

RequestIdSink = Callable[[str], None]
#: The metadata key under which a stored chat completion carries its attempt key, so
#: reconciliation can find it when the response id never arrived.
ATTEMPT_METADATA_KEY = "budget_tasks_attempt"


@dataclass(frozen=True, slots=True)
class Sent:
    """A completed billable call: what it returned, what it used and what it cost."""

    provider: str
    model: str
    request_id: str | None
    response_id: str | None
    usage: Usage | None
    cost: int | None
    result: dict[str, Any]
    #: the SDK's own response object; for a stream, the list of the SDK's own events
    #: (chunks) in the order they came
    response: Any = None


def _dump(obj: Any) -> Any:
    dump = getattr(obj, "model_dump", None)
    return dump(mode="json") if callable(dump) else None


def chat_result(completion: Any) -> dict[str, Any]:
    """What a task keeps of a chat completion: the first choice's text, and the whole
    completion as JSON under ``response`` (every choice, tool calls, refusals)."""
    choice = completion.choices[0] if completion.choices else None
    return {
        "id": completion.id,
        "content": choice.message.content if choice else None,
        "finish_reason": choice.finish_reason if choice else None,
        "response": _dump(completion),
    }


def message_result(message: Any) -> dict[str, Any]:
    """What a task keeps of an Anthropic message: its text, and the whole message as
    JSON under ``response`` (tool_use blocks included)."""
    text = "".join(getattr(block, "text", "") for block in message.content)
    return {
        "id": message.id,
        "content": text,
        "stop_reason": message.stop_reason,
        "response": _dump(message),
    }


class AttemptLike(Protocol):
    """What the call helpers use of ``attempt=`` (a BudgetTask's ``self.attempt``).
    Reading ``key`` is what grants the send."""

    @property
    def key(self) -> str: ...

    def describe(
        self,
        lookup: str,
        model: str,
        response_id: str | None = None,
        timeout: float | None = None,
    ) -> None: ...
    def record_request_id(self, request_id: str) -> None: ...
    def record(self, sent: Sent) -> None: ...


#: Names of the lookups that can find a call again (see budget_tasks.providers.lookups).
LOOKUP_OPENAI_CHAT = "openai.chat"
LOOKUP_OPENAI_RESPONSES = "openai.responses"
LOOKUP_ANTHROPIC_MESSAGES = "anthropic.messages"
#: A whole Anthropic Message Batch, by its id: settled when it has ended.
LOOKUP_ANTHROPIC_BATCH = "anthropic.batch"
#: A call nothing can find again (a chat completion sent without ``store``).
LOOKUP_NONE = "none"


def _bind(
    client: Any,
    attempt: AttemptLike | None,
    key: str | None,
    on_request_id: RequestIdSink | None,
    lookup: str,
    model: str,
) -> tuple[str, RequestIdSink | None]:
    """The attempt key and request-id sink, from ``attempt=`` or given one by one.

    Everything that can refuse the call is checked first; then the attempt learns what
    the call is, and only then is its key read, which grants the send."""
    require_no_retries(client)
    if attempt is None:
        if key is None:
            raise TypeError("give the attempt key: key=... or attempt=self.attempt")
        return check.text(key, "attempt key"), on_request_id
    attempt.describe(lookup, model, timeout=client_timeout(client))
    return attempt.key, on_request_id or attempt.record_request_id


def _prepare(client: Any, key: str, params: dict[str, Any]) -> dict[str, Any]:
    headers = dict(params.pop("extra_headers", None) or {})
    headers["Idempotency-Key"] = key
    return headers


def _report(request_id: str | None, sink: RequestIdSink | None) -> None:
    if request_id and sink is not None:
        sink(request_id)


def _priced(
    provider: str,
    model: str,
    request_id: str | None,
    used: Usage,
    result: dict[str, Any],
    prices: PriceTable | None,
    response: Any = None,
) -> Sent:
    cost = (prices or default_prices()).cost(model, used)
    return Sent(provider, model, request_id, result["id"], used, cost, result, response)


def openai_chat(
    client: Any,
    *,
    key: str | None = None,
    attempt: AttemptLike | None = None,
    on_request_id: RequestIdSink | None = None,
    prices: PriceTable | None = None,
    store_for_lookup: bool = True,
    **params: Any,
) -> Sent:
    """``client.chat.completions.create(**params)`` as one billable attempt.

    With ``store_for_lookup`` (default) the completion is stored with the attempt key
    in its metadata, so reconciliation can find it by id or, if the id never arrived,
    by that key. Streams ask for the usage chunk and must end with it. With
    ``attempt=self.attempt`` the call is described, its request id and usage recorded.
    """
    lookup = LOOKUP_OPENAI_CHAT if store_for_lookup else LOOKUP_NONE
    key, on_request_id = _bind(client, attempt, key, on_request_id, lookup, params["model"])
    headers = _prepare(client, key, params)
    if store_for_lookup:
        params["store"] = True
        params["metadata"] = {**(params.get("metadata") or {}), ATTEMPT_METADATA_KEY: key}
    streamed = bool(params.get("stream"))
    if streamed:
        params["stream_options"] = {**(params.get("stream_options") or {}), "include_usage": True}
    create = client.chat.completions.with_streaming_response.create
    with create(extra_headers=headers, **params) as response:
        request_id = response.request_id
        _report(request_id, on_request_id)
        if not streamed:
            completion = response.parse()
            if completion.usage is None:
                raise StreamIncomplete("openai", "the completion carried no usage")
            result = chat_result(completion)
            raw_usage = completion.usage
            sdk_response: Any = completion
        else:
            parts: list[str] = []
            finish = completion_id = raw_usage = None
            chunks: list[Any] = []
            for chunk in response.parse():
                chunks.append(chunk)
                completion_id = chunk.id
                for delta in chunk.choices:
                    parts.append(delta.delta.content or "")
                    finish = delta.finish_reason or finish
                raw_usage = chunk.usage or raw_usage
            if finish is None or raw_usage is None:
                raise StreamIncomplete(
                    "openai", "no finish_reason" if finish is None else "no usage chunk"
                )
            result = {"id": completion_id, "content": "".join(parts), "finish_reason": finish}
            sdk_response = chunks
    used = usage_of.from_openai_chat(raw_usage)
    sent = _priced("openai", params["model"], request_id, used, result, prices, sdk_response)
    return _done(attempt, sent)


def openai_response(
    client: Any,
    *,
    key: str | None = None,
    attempt: AttemptLike | None = None,
    on_request_id: RequestIdSink | None = None,
    prices: PriceTable | None = None,
    **params: Any,
) -> Sent:
    """``client.responses.create(**params)`` as one billable attempt.

    With ``background=True`` the provider answers at once with a queued response:
    ``usage`` and ``cost`` are None and reconciliation settles it by its id.
    """
    if params.get("stream"):
        raise ValueError("streamed Responses calls are not supported; use background=True")
    key, on_request_id = _bind(
        client, attempt, key, on_request_id, LOOKUP_OPENAI_RESPONSES, params["model"]
    )
    headers = _prepare(client, key, params)
    with client.responses.with_streaming_response.create(extra_headers=headers, **params) as r:
        request_id = r.request_id
        _report(request_id, on_request_id)
        response = r.parse()
    result = {
        "id": response.id,
        "status": response.status,
        "output_text": response.output_text,
        "response": _dump(response),
    }
    model = params["model"]
    if response.usage is None:
        return _done(
            attempt, Sent("openai", model, request_id, response.id, None, None, result, response)
        )
    used = usage_of.from_openai_response(response.usage)
    return _done(attempt, _priced("openai", model, request_id, used, result, prices, response))


def anthropic_message(
    client: Any,
    *,
    key: str | None = None,
    attempt: AttemptLike | None = None,
    on_request_id: RequestIdSink | None = None,
    prices: PriceTable | None = None,
    **params: Any,
) -> Sent:
    """``client.messages.create(**params)`` as one billable attempt (plain or streamed).

    Anthropic's Messages API has no lookup: an unknown outcome here stays held until an
    operator resolves it.
    """
    key, on_request_id = _bind(
        client, attempt, key, on_request_id, LOOKUP_ANTHROPIC_MESSAGES, params["model"]
    )
    headers = _prepare(client, key, params)
    with client.messages.with_streaming_response.create(extra_headers=headers, **params) as r:
        request_id = r.request_id
        _report(request_id, on_request_id)
        message: Any = None
        if not params.get("stream"):
            message = r.parse()
            result = message_result(message)
            used = usage_of.from_anthropic(message.usage)
        else:
            events = list(r.parse())
            result, used = _read_anthropic_stream(events)
            message = events
    sent = _priced("anthropic", params["model"], request_id, used, result, prices, message)
    return _done(attempt, sent)


def _done(attempt: AttemptLike | None, sent: Sent) -> Sent:
    if attempt is not None:
        attempt.record(sent)
    return sent


def _read_anthropic_stream(events: Any) -> tuple[dict[str, Any], Usage]:
    parts: list[str] = []
    start_usage: Any = None
    output_tokens = 0
    message_id = stop_reason = None
    finished = False
    for event in events:
        if event.type == "message_start":
            message_id, start_usage = event.message.id, event.message.usage
        elif event.type == "content_block_delta":
            parts.append(getattr(event.delta, "text", "") or "")
        elif event.type == "message_delta":
            output_tokens = event.usage.output_tokens  # cumulative, not a delta
            stop_reason = event.delta.stop_reason
        elif event.type == "message_stop":
            finished = True
    if not finished or start_usage is None:
        raise StreamIncomplete("anthropic", "no message_stop event")
    base = usage_of.from_anthropic(start_usage)
    used = Usage(
        input_tokens=base.input_tokens,
        cached_input_tokens=base.cached_input_tokens,
        cache_write_tokens=base.cache_write_tokens,
        output_tokens=output_tokens,
    )
    return {"id": message_id, "content": "".join(parts), "stop_reason": stop_reason}, used
