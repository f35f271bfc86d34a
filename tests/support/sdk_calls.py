"""Billable calls through the official SDKs, metered under an attempt's key: the test
harness's way to exercise a main call (``estimate_cost`` with ``self.attempt``) and
the lookups that find such a call again. Users meter through the guarded clients or
``spend()``; these helpers left the package with issue 42.

Each call refuses a client whose SDK retries are on, sends the attempt key as the
``Idempotency-Key`` header, hands the provider's request id to ``on_request_id`` as
soon as the response headers arrive (before the body, for streams too), reads the
usage and prices it. Errors are the SDKs' own; :func:`classify` says what they mean.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

from budget_tasks import _validate as check
from budget_tasks import bypass
from budget_tasks._trust import Bound
from budget_tasks.errors import BudgetTasksError, StreamIncomplete
from budget_tasks.pricing import Estimate, Prices
from budget_tasks.providers.anthropic import usage as anthropic_usage
from budget_tasks.providers.anthropic.lookups import message_result
from budget_tasks.providers.base import Reported, Sent, as_json, request_digest
from budget_tasks.providers.clients import client_timeout, require_no_retries
from budget_tasks.providers.estimates import anthropic_message as estimate_message
from budget_tasks.providers.estimates import openai_chat as estimate_chat
from budget_tasks.providers.estimates import openai_response as estimate_response
from budget_tasks.providers.openai import LOOKUP_CHAT, LOOKUP_RESPONSES
from budget_tasks.providers.openai import usage as openai_usage
from budget_tasks.providers.openai.lookups import (
    ATTEMPT_METADATA_KEY,
    REQUEST_METADATA_KEY,
    chat_result,
)

RequestIdSink = Callable[[str], None]


class AttemptLike(Protocol):
    """What the call helpers use of ``attempt=`` (a BudgetTask's ``self.attempt``).
    Reading ``key`` is what grants the send."""

    @property
    def key(self) -> str: ...

    @property
    def provider_key(self) -> str: ...

    def describe(
        self,
        lookup: str,
        model: str,
        response_id: str | None = None,
        timeout: float | None = None,
        request: str | None = None,
        bound: Bound | None = None,
    ) -> None: ...
    def record_request_id(self, request_id: str) -> None: ...
    def record(self, sent: Sent) -> None: ...


#: Names of the lookups that can find a call again (see budget_tasks.providers.lookups).
LOOKUP_OPENAI_CHAT = LOOKUP_CHAT
LOOKUP_OPENAI_RESPONSES = LOOKUP_RESPONSES
LOOKUP_ANTHROPIC_MESSAGES = "anthropic.messages"
#: A whole Anthropic Message Batch, by its id: settled when it has ended.
LOOKUP_ANTHROPIC_BATCH = "anthropic.batch"
#: A call nothing can find again (a chat completion sent without ``store``).
LOOKUP_NONE = "none"


def bound_of(
    estimator: Callable[..., Estimate], params: dict[str, Any], prices: Prices | None
) -> Bound | None:
    """The most tokens ``params`` allow, by the endpoint's estimator, where it can bound
    them (a call made under an explicit estimate may send what it cannot)."""
    try:
        return Bound.of(estimator(params, prices))
    except (BudgetTasksError, TypeError, ValueError):
        return None


def _bind(
    client: Any,
    attempt: AttemptLike | None,
    key: str | None,
    on_request_id: RequestIdSink | None,
    lookup: str,
    params: dict[str, Any],
    bound: Bound | None,
) -> tuple[str, RequestIdSink | None]:
    """The key the provider is sent and the request-id sink, from ``attempt=`` (its
    provider key: an opaque digest of the ledger's installation and the attempt key),
    or given one by one (``key=``, sent as it is).

    Everything that can refuse the call is checked first; then the attempt learns what
    the call is, and only then is its key read, which grants the send."""
    require_no_retries(client)
    if attempt is None:
        if key is None:
            raise TypeError("give the attempt key: key=... or attempt=self.attempt")
        return check.key(key, "attempt key"), on_request_id
    timeout = client_timeout(client)
    attempt.describe(
        lookup,
        params["model"],
        timeout=math.inf if timeout is None else timeout,
        request=request_digest(params),
        bound=bound,
    )
    return attempt.provider_key, on_request_id or attempt.record_request_id


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
    reported: Reported | None,
    result: dict[str, Any],
    prices: Prices | None,
    response: Any = None,
    bound: Bound | None = None,
) -> Sent:
    if reported is None:
        raise StreamIncomplete(provider, "the answer carried no usage")
    cost = reported.cost(prices, provider, None)
    # the model that answered (a snapshot of the one asked for), as the transport says
    answered = reported.parts[0].model if reported.parts else model
    return Sent(
        provider,
        answered or model,
        request_id,
        result["id"],
        reported.usage,
        cost,
        result,
        response,
        bound,
    )


def _metered(helper: Callable[..., Sent]) -> Callable[..., Sent]:
    """A call helper's connections are the guard's own: it sends under the attempt's key
    and records what the call used (see :mod:`budget_tasks.bypass`)."""

    @functools.wraps(helper)
    def call(*args: Any, **kwargs: Any) -> Sent:
        with bypass.guarded():
            return helper(*args, **kwargs)

    return call


@_metered
def openai_chat(
    client: Any,
    *,
    key: str | None = None,
    attempt: AttemptLike | None = None,
    on_request_id: RequestIdSink | None = None,
    prices: Prices | None = None,
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
    digest = request_digest(params)
    bound = bound_of(estimate_chat, params, prices)
    key, on_request_id = _bind(client, attempt, key, on_request_id, lookup, params, bound)
    headers = _prepare(client, key, params)
    if store_for_lookup:
        params["store"] = True
        params["metadata"] = {
            **(params.get("metadata") or {}),
            ATTEMPT_METADATA_KEY: key,
            REQUEST_METADATA_KEY: digest,
        }
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
            reported = openai_usage.chat(completion, params)
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
            reported = openai_usage.chat_stream([as_json(c) for c in chunks], params)
    sent = _priced(
        "openai", params["model"], request_id, reported, result, prices, sdk_response, bound
    )
    return _done(attempt, sent)


@_metered
def openai_response(
    client: Any,
    *,
    key: str | None = None,
    attempt: AttemptLike | None = None,
    on_request_id: RequestIdSink | None = None,
    prices: Prices | None = None,
    **params: Any,
) -> Sent:
    """``client.responses.create(**params)`` as one billable attempt.

    With ``background=True`` the provider answers at once with a queued response:
    ``usage`` and ``cost`` are None and reconciliation settles it by its id.
    """
    if params.get("stream"):
        raise ValueError("streamed Responses calls are not supported; use background=True")
    bound = bound_of(estimate_response, params, prices)
    key, on_request_id = _bind(
        client, attempt, key, on_request_id, LOOKUP_OPENAI_RESPONSES, params, bound
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
        "response": as_json(response),
    }
    model = params["model"]
    if response.usage is None:
        return _done(
            attempt,
            Sent("openai", model, request_id, response.id, None, None, result, response, bound),
        )
    reported = openai_usage.response(response, params)
    sent = _priced("openai", model, request_id, reported, result, prices, response, bound)
    return _done(attempt, sent)


@_metered
def anthropic_message(
    client: Any,
    *,
    key: str | None = None,
    attempt: AttemptLike | None = None,
    on_request_id: RequestIdSink | None = None,
    prices: Prices | None = None,
    **params: Any,
) -> Sent:
    """``client.messages.create(**params)`` as one billable attempt (plain or streamed).

    Anthropic's Messages API has no lookup: an unknown outcome here stays held until an
    operator resolves it.
    """
    bound = bound_of(estimate_message, params, prices)
    key, on_request_id = _bind(
        client, attempt, key, on_request_id, LOOKUP_ANTHROPIC_MESSAGES, params, bound
    )
    headers = _prepare(client, key, params)
    with client.messages.with_streaming_response.create(extra_headers=headers, **params) as r:
        request_id = r.request_id
        _report(request_id, on_request_id)
        message: Any = None
        if not params.get("stream"):
            message = r.parse()
            result = message_result(message)
            reported = anthropic_usage.message(message, params)
        else:
            events = list(r.parse())
            result = _read_anthropic_stream(events)
            reported = anthropic_usage.message_stream([as_json(e) for e in events], params)
            message = events
    sent = _priced(
        "anthropic", params["model"], request_id, reported, result, prices, message, bound
    )
    return _done(attempt, sent)


def _done(attempt: AttemptLike | None, sent: Sent) -> Sent:
    if attempt is not None:
        attempt.record(sent)
    return sent


def _read_anthropic_stream(events: Any) -> dict[str, Any]:
    parts: list[str] = []
    message_id = stop_reason = None
    finished = False
    for event in events:
        if event.type == "message_start":
            message_id = event.message.id
        elif event.type == "content_block_delta":
            parts.append(getattr(event.delta, "text", "") or "")
        elif event.type == "message_delta":
            stop_reason = event.delta.stop_reason
        elif event.type == "message_stop":
            finished = True
    if not finished or message_id is None:
        raise StreamIncomplete("anthropic", "no message_stop event")
    return {"id": message_id, "content": "".join(parts), "stop_reason": stop_reason}
