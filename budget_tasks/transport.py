"""The guarded transport: the SDKs' own code (or any library that takes an HTTP client)
unchanged, each billable request its own reserved attempt.

Install it with :func:`guarded_http_client` (an ``httpx2.Client``, which the official
``openai`` and ``anthropic`` SDKs take as ``http_client=``), or with
``openai_client(guarded=True)`` / ``anthropic_client(guarded=True)``. Inside a
BudgetTask's ``run``, each billable request (chat completions, Responses, Messages) is:

1. estimated from its JSON body (an upper bound; a body it cannot bound is refused
   before any byte is sent, naming the field: ``EstimateRefused``);
2. reserved, as the next call of its endpoint in this operation (its *position*:
   ``op:<endpoint>:n``), and granted;
3. sent with the attempt key as ``Idempotency-Key``; its request id recorded as soon
   as the headers arrive; the whole response read, its usage priced and settled;
4. stored, response bytes and all, so that a redelivery that makes the same call at the
   same position gets the stored response back without sending (a different request
   body there is :class:`~budget_tasks.errors.CallConflict`; a call whose outcome is
   unknown raises ``OutcomeUnknown``, never a resend).

Streams pass to the SDK as they arrive and settle at their end (usage from the final
event); one cut or left before its usage arrived keeps its hold as unknown. Outside a
BudgetTask a billable request is refused (:class:`~budget_tasks.errors.UnguardedCall`)
unless the client was built with ``allow_unguarded=True``; other requests (lookups,
model lists, files) pass.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx2

from .delivery import AttemptScope, Call, current_scope
from .errors import (
    BudgetTasksError,
    CallConflict,
    EstimateRefused,
    RetriesEnabled,
    SdkRetryRefused,
    StepNotReplayable,
    StreamIncomplete,
    UnguardedCall,
)
from .ledger import CallFacts
from .pricing import Estimate, PriceTable, Usage, default_prices
from .providers import estimates
from .providers import usage as usage_of
from .providers.calls import (
    ATTEMPT_METADATA_KEY,
    LOOKUP_ANTHROPIC_BATCH,
    LOOKUP_ANTHROPIC_MESSAGES,
    LOOKUP_NONE,
    LOOKUP_OPENAI_CHAT,
    LOOKUP_OPENAI_RESPONSES,
    Sent,
)
from .providers.clients import _refuse_retries

#: The header by which the official SDKs mark a request they send again on their own.
RETRY_HEADER = "x-stainless-retry-count"
#: Version of what a guarded call stores for replay.
STORED_VERSION = 1
#: Response headers kept with a stored response (what the SDKs read).
KEPT_HEADERS = ("content-type", "x-request-id", "request-id", "openai-processing-ms")


@dataclass(frozen=True)
class Endpoint:
    """A billable endpoint: how to bound a request to it and read what it used."""

    name: str
    provider: str
    path: re.Pattern[str]
    estimate: Callable[[Mapping[str, Any], PriceTable | None], Estimate]
    usage: Callable[[Any], Usage]

    def lookup(self, body: Mapping[str, Any]) -> str:
        if self.name == "openai.chat":
            return LOOKUP_OPENAI_CHAT if body.get("store") else LOOKUP_NONE
        if self.name == "anthropic.messages":
            return LOOKUP_ANTHROPIC_MESSAGES
        if self.name == "anthropic.batches":
            return LOOKUP_ANTHROPIC_BATCH
        if self.name == "openai.responses":
            return LOOKUP_OPENAI_RESPONSES
        return LOOKUP_NONE


def _anthropic_batch_estimate(body: Mapping[str, Any], prices: PriceTable | None) -> Estimate:
    """An Anthropic Message Batch: the sum of its requests' bounds, at full price (the
    batch discount only lowers what is billed)."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise EstimateRefused("a message batch without requests: nothing to bound it by")
    parts = [
        estimates.anthropic_message((item or {}).get("params") or {}, prices) for item in requests
    ]
    return Estimate(
        amount=sum(p.amount for p in parts),
        model=parts[0].model,
        input_tokens=sum(p.input_tokens for p in parts),
        output_tokens=sum(p.output_tokens for p in parts),
        price_version=parts[0].price_version,
    )


ENDPOINTS = (
    Endpoint(
        "openai.chat",
        "openai",
        re.compile(r"/chat/completions/?$"),
        estimates.openai_chat,
        usage_of.from_openai_chat,
    ),
    Endpoint(
        "openai.responses",
        "openai",
        re.compile(r"/responses/?$"),
        estimates.openai_response,
        usage_of.from_openai_response,
    ),
    Endpoint(
        "anthropic.batches",
        "anthropic",
        re.compile(r"/v1/messages/batches/?$"),
        _anthropic_batch_estimate,
        usage_of.from_anthropic,  # a batch answers without usage: read when it ends
    ),
    Endpoint(
        "anthropic.messages",
        "anthropic",
        re.compile(r"/v1/messages/?$"),
        estimates.anthropic_message,
        usage_of.from_anthropic,
    ),
)


#: OpenAI batch creation: its requests are in an uploaded file, not in the body, so
#: nothing bounds it here: refused unless the client allows it.
BATCH_PATHS = re.compile(r"/v1/batches/?$")


_local = threading.local()


def _labels() -> list[str]:
    labels: list[str] = getattr(_local, "labels", None) or []
    return labels


@contextmanager
def call_label(name: str) -> Iterator[None]:
    """Count the calls made inside this block apart, under ``name``: their positions
    are ``<key>:<name>/<endpoint>:n``. A loop whose branches make calls in an order
    that may differ between runs gives each branch its label, so a redelivery still
    meets each call at its own position."""
    if not isinstance(name, str) or not name:
        raise ValueError("a call label is a non-empty string")
    labels = _labels()
    _local.labels = [*labels, name]
    try:
        yield
    finally:
        _local.labels = labels


def endpoint_of(request: httpx2.Request) -> Endpoint | None:
    """The billable endpoint a request goes to, or None (it passes untouched)."""
    if request.method != "POST":
        return None
    for endpoint in ENDPOINTS:
        if endpoint.path.search(request.url.path):
            return endpoint
    return None


class _StatusOutcome(Exception):
    """An error status from the provider, raised inside the call's block so its hold
    follows the status (429 and refusals released, 5xx kept unknown), then the
    response goes back to the SDK, which raises its own error."""

    def __init__(self, response: httpx2.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.status_code = response.status_code


class GuardedTransport(httpx2.BaseTransport):
    """An ``httpx2`` transport that meters billable requests through the ledger."""

    def __init__(
        self,
        inner: httpx2.BaseTransport | None = None,
        *,
        allow_unguarded: bool = False,
        allow_batches: bool = False,
        prices: PriceTable | None = None,
    ) -> None:
        self.inner = inner or httpx2.HTTPTransport()
        self.allow_unguarded = allow_unguarded
        self.allow_batches = allow_batches
        self.prices = prices

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        endpoint = endpoint_of(request)
        if endpoint is None:
            if (
                request.method == "POST"
                and BATCH_PATHS.search(request.url.path)
                and not self.allow_batches
            ):
                raise _marked(
                    EstimateRefused(
                        "batch creation is not metered by the guarded transport (its cost "
                        "is known when the batch ends): reserve for it with self.spend() and "
                        "a client built with allow_batches=True"
                    )
                )
            return self.inner.handle_request(request)
        retry = request.headers.get(RETRY_HEADER, "0")
        if retry.strip() not in ("", "0"):
            raise _marked(SdkRetryRefused(request.url.path, retry))
        scope = current_scope()
        if scope is None:
            if self.allow_unguarded:
                return self.inner.handle_request(request)
            raise _marked(UnguardedCall(request.method, request.url.path))
        try:
            return self._guarded(scope, endpoint, request)
        except BudgetTasksError as exc:
            raise _marked(exc) from None

    def close(self) -> None:
        self.inner.close()

    def _guarded(
        self, scope: AttemptScope, endpoint: Endpoint, request: httpx2.Request
    ) -> httpx2.Response:
        raw = request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            raise EstimateRefused("the request body is not JSON: nothing to bound it by") from None
        if not isinstance(body, dict):
            raise EstimateRefused("the request body is not a JSON object: nothing to bound it by")
        streamed = bool(body.get("stream"))
        hidden_usage = False
        if streamed and endpoint.name == "openai.chat":
            # the usage arrives only in a last chunk the request asks for; the SDK is
            # not shown that chunk unless the caller asked for it (code that reads
            # chunk.choices[0] of every chunk would break on it)
            options = body.get("stream_options") or {}
            if not options.get("include_usage"):
                body["stream_options"] = {**options, "include_usage": True}
                request = _with_body(request, body)
                hidden_usage = True
        estimate = endpoint.estimate(body, self.prices)
        digest = _digest(body)
        manager = scope.manager
        assert manager is not None
        label = endpoint.name if not _labels() else f"{_labels()[-1]}/{endpoint.name}"
        # Entered by hand: a live stream's call ends when the SDK has read it, after
        # this method returned.
        facts = CallFacts(endpoint.lookup(body), estimate.model, _timeout(request))
        step = manager.step(scope, estimate.amount, label, facts)
        call = step.__enter__()
        try:
            if call.replayed:
                answer: httpx2.Response | _LiveStream = _replay(
                    scope, call, digest, request, streamed
                )
            else:
                answer = self._send(
                    call, endpoint, request, body, digest, streamed, hidden_usage, estimate.model
                )
        except BaseException as exc:
            step.__exit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, _StatusOutcome):
                return exc.response
            raise
        if isinstance(answer, _LiveStream):
            return answer.start(step)
        step.__exit__(None, None, None)
        return answer

    def _send(
        self,
        call: Call,
        endpoint: Endpoint,
        request: httpx2.Request,
        body: dict[str, Any],
        digest: str,
        streamed: bool,
        hidden_usage: bool,
        model: str,
    ) -> httpx2.Response | _LiveStream:
        call.describe(endpoint.lookup(body), model, timeout=_timeout(request))
        key = call.key  # reading the key grants the send
        if endpoint.name == "openai.chat" and body.get("store"):
            # a stored completion carries its attempt key: reconciliation finds it even
            # when the response (and its id) never arrived
            body["metadata"] = {**(body.get("metadata") or {}), ATTEMPT_METADATA_KEY: key}
            request = _with_body(request, body)
        request.headers["Idempotency-Key"] = key
        response = self.inner.handle_request(request)
        request_id = response.headers.get("x-request-id") or response.headers.get("request-id")
        if request_id:
            call.record_request_id(request_id)
        if streamed and response.status_code < 400:
            return _LiveStream(
                call, endpoint, response, request, digest, hidden_usage, model, self.prices
            )
        full = response.read()
        response.close()
        content = _without_usage_chunk(full) if hidden_usage else full
        stored = {
            "v": STORED_VERSION,
            "request": digest,
            "status": response.status_code,
            "headers": [[k, v] for k, v in response.headers.items() if k.lower() in KEPT_HEADERS],
            "body": content.decode("utf-8", errors="replace"),
        }
        answer = httpx2.Response(
            response.status_code,
            headers=[*_decoded_headers(response.headers), ("content-length", str(len(content)))],
            content=content,
            request=request,
            extensions={k: v for k, v in response.extensions.items() if k != "network_stream"},
        )
        if response.status_code >= 400:
            raise _StatusOutcome(answer)
        used, response_id = _usage(endpoint, full, streamed)
        if used is None:
            # answered without usage (a background Response): reconciliation reads it
            call.record(Sent(endpoint.provider, model, request_id, response_id, None, None, stored))
            return answer
        cost = (self.prices or default_prices()).cost(model, used)
        call.record(Sent(endpoint.provider, model, request_id, response_id, used, cost, stored))
        return answer


class _LiveStream(httpx2.SyncByteStream):
    """A streamed answer passed to the SDK as it arrives. The call is settled when the
    stream ends (its usage from the last event); cut or closed before its end, the
    call's outcome is unknown and its hold kept."""

    def __init__(
        self,
        call: Call,
        endpoint: Endpoint,
        response: httpx2.Response,
        request: httpx2.Request,
        digest: str,
        hidden_usage: bool,
        model: str,
        prices: PriceTable | None,
    ) -> None:
        self.call, self.endpoint, self.inner, self.request = call, endpoint, response, request
        self.digest, self.hidden_usage, self.model, self.prices = (
            digest,
            hidden_usage,
            model,
            prices,
        )
        self.full: list[bytes] = []
        self.shown: list[bytes] = []
        self.step: Any = None
        self.finished = False

    def start(self, step: Any) -> httpx2.Response:
        self.step = step
        return httpx2.Response(
            self.inner.status_code,
            headers=_decoded_headers(self.inner.headers),
            stream=self,
            request=self.request,
            extensions={k: v for k, v in self.inner.extensions.items() if k != "network_stream"},
        )

    def __iter__(self) -> Iterator[bytes]:
        pending = b""
        try:
            # decoded here (the answer may be compressed): the usage is read from, and the
            # SDK is handed, the decoded events
            for chunk in self.inner.iter_bytes():
                self.full.append(chunk)
                if not self.hidden_usage:
                    self.shown.append(chunk)
                    yield chunk
                    continue
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    kept = _without_usage_chunk(event)
                    if kept.strip():
                        self.shown.append(kept + b"\n\n")
                        yield kept + b"\n\n"
            if pending:
                self.shown.append(pending)
                yield pending
        except GeneratorExit:
            # the SDK stops reading (after [DONE], or the caller broke off): settled if
            # the usage had arrived, else unknown
            self._finish(None)
            raise
        except BaseException as exc:
            self._finish(exc)
            raise
        self._finish(None)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        if exc is None:
            used, response_id = _usage(self.endpoint, b"".join(self.full), True)
            if used is None:
                exc = StreamIncomplete(self.endpoint.provider, "closed before its usage arrived")
            else:
                stored = {
                    "v": STORED_VERSION,
                    "request": self.digest,
                    "status": self.inner.status_code,
                    "headers": [
                        [k, v] for k, v in self.inner.headers.items() if k.lower() in KEPT_HEADERS
                    ],
                    "body": b"".join(self.shown).decode("utf-8", errors="replace"),
                }
                cost = (self.prices or default_prices()).cost(self.model, used)
                request_id = self.call.request_id
                provider = self.endpoint.provider
                self.call.record(
                    Sent(provider, self.model, request_id, response_id, used, cost, stored)
                )
                self.step.__exit__(None, None, None)
                return
        self.step.__exit__(type(exc), exc, exc.__traceback__)


def _replay(
    scope: AttemptScope, call: Call, digest: str, request: httpx2.Request, streamed: bool
) -> httpx2.Response:
    stored = call.result
    if call.reconciled and isinstance(stored, dict) and isinstance(stored.get("response"), dict):
        if streamed:
            raise StepNotReplayable(scope.operation_key, call.key)  # no events were kept
        # what reconciliation found at the provider: the whole response, as JSON
        content = json.dumps(stored["response"]).encode()
        return httpx2.Response(
            200,
            headers=[("content-type", "application/json"), ("content-length", str(len(content)))],
            content=content,
            request=request,
        )
    if not isinstance(stored, dict) or stored.get("v") != STORED_VERSION:
        # billed, and nothing replayable is stored: not sent again
        raise StepNotReplayable(scope.operation_key, call.key)
    if stored["request"] != digest:
        raise CallConflict(scope.operation_key, call.key)
    content = str(stored["body"]).encode()
    headers = [(k, v) for k, v in stored["headers"] if k.lower() != "content-length"]
    return httpx2.Response(
        int(stored["status"]),
        headers=[*headers, ("content-length", str(len(content)))],
        content=content,
        request=request,
    )


def _usage(endpoint: Endpoint, content: bytes, streamed: bool) -> tuple[Usage | None, str | None]:
    """The usage and the response id in a response body (JSON, or server-sent events)."""
    if not streamed:
        data = json.loads(content)
        raw = data.get("usage")
        return (endpoint.usage(raw) if raw else None), data.get("id")
    raw_usage: dict[str, Any] = {}
    response_id = None
    for line in content.decode("utf-8", errors="replace").splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if endpoint.provider == "anthropic":
            if event.get("type") == "message_start":
                message = event.get("message") or {}
                response_id = message.get("id")
                raw_usage.update(message.get("usage") or {})
            elif event.get("type") == "message_delta":
                raw_usage.update(event.get("usage") or {})  # output_tokens, cumulative
        else:
            response_id = event.get("id") or response_id
            if event.get("usage"):
                raw_usage = event["usage"]
            if isinstance(event.get("response"), dict) and event["response"].get("usage"):
                raw_usage = event["response"]["usage"]
    return (endpoint.usage(raw_usage) if raw_usage else None), response_id


def _without_usage_chunk(content: bytes) -> bytes:
    """A chat stream without the usage-only chunk (no choices) the transport asked for."""
    kept = []
    for event in content.split(b"\n\n"):
        data = event.strip()
        if data.startswith(b"data:") and data[5:].strip() != b"[DONE]":
            try:
                chunk = json.loads(data[5:])
            except ValueError:
                chunk = None
            if isinstance(chunk, dict) and not chunk.get("choices") and chunk.get("usage"):
                continue
        kept.append(event)
    return b"\n\n".join(kept)


def _decoded_headers(headers: httpx2.Headers) -> list[tuple[str, str]]:
    """A provider's response headers for the body the transport hands on, which it has
    decoded: without Content-Encoding (the SDK would decode it a second time) and
    without the length of the encoded body."""
    dropped = ("content-encoding", "content-length")
    return [(k, v) for k, v in headers.items() if k.lower() not in dropped]


def _digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _with_body(request: httpx2.Request, body: dict[str, Any]) -> httpx2.Request:
    content = json.dumps(body).encode()
    headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
    return httpx2.Request(
        request.method,
        request.url,
        headers=headers,
        content=content,
        extensions=request.extensions,
    )


def _timeout(request: httpx2.Request) -> float | None:
    parts = (request.extensions.get("timeout") or {}).values()
    finite = [float(p) for p in parts if isinstance(p, int | float)]
    return sum(finite) if finite else None


def _marked(exc: BudgetTasksError) -> BudgetTasksError:
    """Mark an error of ours raised inside the transport: an SDK that wraps it (as a
    connection error) does not hide it from the task (see :func:`raised_by_transport`)."""
    exc.__dict__["budget_tasks_transport"] = True
    return exc


def raised_by_transport(exc: BaseException) -> BudgetTasksError | None:
    """The error the guarded transport raised under ``exc`` (an SDK's wrapper), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, BudgetTasksError) and current.__dict__.get("budget_tasks_transport"):
            return current
        current = current.__cause__ or current.__context__
    return None


def guarded_http_client(
    *,
    allow_unguarded: bool = False,
    allow_batches: bool = False,
    prices: PriceTable | None = None,
    **options: Any,
) -> httpx2.Client:
    """An ``httpx2.Client`` whose billable requests go through the ledger; give it to
    an SDK (``openai.OpenAI(http_client=..., max_retries=0)``) or any library that takes
    one. ``options`` go to ``httpx2.Client`` (``timeout=...``). ``allow_batches`` lets
    batch creation through unmetered (reserve for it yourself)."""
    return httpx2.Client(
        transport=GuardedTransport(
            allow_unguarded=allow_unguarded, allow_batches=allow_batches, prices=prices
        ),
        **options,
    )


def guarded_openai_client(*, allow_unguarded: bool = False, **kwargs: Any) -> Any:
    """``openai.OpenAI(**kwargs)`` with retries off and the guarded transport; its
    ``copy``/``with_options`` refuse to turn retries back on or to swap the transport."""
    _refuse_retries("guarded_openai_client(...)", kwargs)
    timeout = kwargs.get("timeout", 600.0)
    http = guarded_http_client(allow_unguarded=allow_unguarded, timeout=timeout)
    return _guarded_class("openai", "OpenAI")(**{**kwargs, "max_retries": 0, "http_client": http})


def guarded_anthropic_client(*, allow_unguarded: bool = False, **kwargs: Any) -> Any:
    """``anthropic.Anthropic(**kwargs)`` with retries off and the guarded transport; its
    ``copy``/``with_options`` refuse to turn retries back on or to swap the transport."""
    _refuse_retries("guarded_anthropic_client(...)", kwargs)
    timeout = kwargs.get("timeout", 600.0)
    http = guarded_http_client(allow_unguarded=allow_unguarded, timeout=timeout)
    return _guarded_class("anthropic", "Anthropic")(
        **{**kwargs, "max_retries": 0, "http_client": http}
    )


_classes: dict[tuple[str, str], type] = {}


def _guarded_class(module: str, name: str) -> type:
    """A subclass of an SDK's client whose retries stay off: ``max_retries`` cannot be
    set above 0, and ``copy``/``with_options`` keep a guarded HTTP client."""
    found = _classes.get((module, name))
    if found is not None:
        return found
    import importlib

    base = getattr(importlib.import_module(module), name)

    def _get_retries(self: Any) -> int:
        return 0

    def _set_retries(self: Any, value: object) -> None:
        if value != 0 or isinstance(value, bool):
            raise RetriesEnabled(f"a guarded {module} client", value)

    def copy(self: Any, *args: Any, **kwargs: Any) -> Any:
        http = kwargs.get("http_client")
        if http is not None and not isinstance(getattr(http, "_transport", None), GuardedTransport):
            raise ValueError(
                "a guarded client keeps its guarded http client: give copy()/with_options() "
                "a budget_tasks.transport.guarded_http_client(), or none"
            )
        return base.copy(self, *args, **kwargs)

    guarded = type(
        f"Guarded{name}",
        (base,),
        {
            "max_retries": property(_get_retries, _set_retries),
            "copy": copy,
            "with_options": copy,
            "__module__": __name__,
        },
    )
    _classes[(module, name)] = guarded
    return guarded


__all__ = [
    "ENDPOINTS",
    "Endpoint",
    "GuardedTransport",
    "call_label",
    "endpoint_of",
    "guarded_anthropic_client",
    "guarded_http_client",
    "guarded_openai_client",
    "raised_by_transport",
]
