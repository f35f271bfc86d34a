"""What the sync and the async guarded transports share, with no I/O of its own: the
decision on a request (metered, free, refused), the bound and the facts a metered call
is reserved with, what is kept of its answer for replay and what that answer cost.

Both transports follow the same steps; only the sending and the reading differ:

1. decide (the registry): free passes, refused raises, metered goes on;
2. refuse a request the SDK marks as its own retry, and one made outside a run;
3. bound it from its JSON body (refused, naming the field, when it cannot be), and
   reserve it as the next call at its position (``op:<label/>endpoint:n``);
4. send it under the attempt's provider key (``Idempotency-Key``), read the answer
   (decoded: real APIs compress), price what it reports, settle, store it;
5. on a redelivery, the stored answer at that position is handed back instead.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx2

from .._trust import Bound
from ..errors import (
    BudgetTasksError,
    CallConflict,
    EstimateRefused,
    MissingApiKey,
    RefusedEndpoint,
    SdkRetryRefused,
    StepNotReplayable,
    UnguardedCall,
    mark_raised_by_transport,
)
from ..ledger import CallFacts
from ..pricing import Estimate, Prices
from ..providers.base import Endpoint, Kind, Reported, Sent, Vendor, request_digest
from ..providers.registry import Route, registry
from ..providers.reports import hint_of
from ..rate_limits import claim_of
from .positions import position_label

#: The header by which the official SDKs mark a request they send again on their own.
RETRY_HEADER = "x-stainless-retry-count"
#: Version of what a guarded call stores for replay.
STORED_VERSION = 1
#: Response headers kept with a stored response (what the SDKs read).
KEPT_HEADERS = ("content-type", "x-request-id", "request-id", "openai-processing-ms")


#: The API key a guarded SDK client is built with when none was given or set: a task
#: module imports without secrets; a billable request carrying it is refused
#: (:class:`~budget_tasks.errors.MissingApiKey`).
MISSING_API_KEY = "budget-tasks-no-api-key"


def marked(exc: BudgetTasksError) -> BudgetTasksError:
    return mark_raised_by_transport(exc)


@dataclass(frozen=True)
class Options:
    """A guarded transport's settings."""

    allow_unguarded: bool = False
    #: names of refused endpoints let through unmetered (``openai.batches``)
    allow: tuple[str, ...] = ()
    prices: Prices | None = None
    #: the vendor the client was built for (None: by host, else by every vendor's rules)
    vendor: str | None = None
    #: the most one image (or other media item) may cost, in tokens: media in a request
    #: is bounded by it, and refused without it
    image_tokens: int | None = None
    #: ask OpenAI to store a chat completion the request does not say about (``store``),
    #: so reconciliation can look it up should its answer never arrive
    store_for_lookup: bool = True


def decide(request: httpx2.Request, options: Options) -> Route:
    """Metered, free or refused; refused raises (marked) unless allowed by name."""
    route = registry.route(request.method, request.url.host, request.url.path, options.vendor)
    if route.kind is Kind.REFUSED and route.name not in options.allow:
        raise marked(
            RefusedEndpoint(
                reason=route.why, method=request.method, path=request.url.path, name=route.name
            )
        )
    return route


def check_not_a_retry(request: httpx2.Request) -> None:
    retry = request.headers.get(RETRY_HEADER, "0")
    if retry.strip() not in ("", "0"):
        raise marked(SdkRetryRefused(path=request.url.path, retry=retry))


def check_key(request: httpx2.Request, vendor: str | None) -> None:
    """Refuse a request from a guarded SDK client built without an API key."""
    sent = request.headers.get("authorization", "") + request.headers.get("x-api-key", "")
    if MISSING_API_KEY in sent:
        known = registry.find(vendor) if vendor else None
        env = known.key_env if known is not None and known.key_env else "the API key variable"
        raise marked(MissingApiKey(vendor or "provider", env))


def unguarded(request: httpx2.Request) -> BudgetTasksError:
    return marked(UnguardedCall(request.method, request.url.path))


@dataclass
class Metered:
    """One metered request, prepared: its body, bound, digest and position label."""

    route: Route
    endpoint: Endpoint
    request: httpx2.Request
    body: dict[str, Any]
    estimate: Estimate
    digest: str
    label: str
    streamed: bool
    #: the transport asked for a stream's usage chunk the caller did not ask for
    hidden_usage: bool
    facts: CallFacts
    prices: Prices | None

    @property
    def credential(self) -> str | None:
        """The hint of the API key the request is sent with (never the key)."""
        return credential_of(self.request)

    @property
    def provider(self) -> str:
        rate = self.facts.rate
        assert rate is not None  # every metered request claims its rate windows
        return rate.provider

    @property
    def price_provider(self) -> str | None:
        vendor = self.route.vendor
        return vendor.price_provider if vendor is not None else None


def credential_of(request: httpx2.Request) -> str | None:
    """The hint (:func:`~budget_tasks.providers.reports.hint_of`) of the API key a
    request carries, as a bearer token or ``x-api-key``; None where it carries none."""
    secret = request.headers.get("x-api-key")
    if secret is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        secret = token if scheme.lower() == "bearer" else None
    return hint_of(secret.strip()) if secret and secret.strip() else None


def prepare(route: Route, request: httpx2.Request, options: Options) -> Metered:
    """Read and bound a metered request (refused, naming why, if it cannot be)."""
    endpoint = route.endpoint
    assert endpoint is not None
    raw = request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        raise marked(
            EstimateRefused("the request body is not JSON: nothing to bound it by")
        ) from None
    if not isinstance(body, dict):
        raise marked(
            EstimateRefused("the request body is not a JSON object: nothing to bound it by")
        )
    streamed = bool(body.get("stream"))
    hidden_usage = False
    if streamed and endpoint.name.endswith((".chat", ".completions")):
        # the usage arrives only in a last chunk the request asks for; the SDK is not
        # shown that chunk unless the caller asked for it (code that reads
        # chunk.choices[0] of every chunk would break on it)
        stream_options = body.get("stream_options") or {}
        if not stream_options.get("include_usage"):
            body["stream_options"] = {**stream_options, "include_usage": True}
            request = with_body(request, body)
            hidden_usage = True
    if options.store_for_lookup and _stores_by_default(route) and "store" not in body:
        # the one way to find a chat completion whose answer never arrived (a timeout):
        # stored, with the attempt's key in its metadata (see addressed())
        body["store"] = True
        request = with_body(request, body)
    if streamed and endpoint.stream_usage is None:
        raise marked(EstimateRefused(f"a streamed {endpoint.name} answer is not metered yet"))
    try:
        estimate = endpoint.estimate(body, options.prices, image_tokens=options.image_tokens)
    except BudgetTasksError as exc:
        raise marked(exc) from None
    digest = request_digest(body)
    bound = Bound.of(estimate)
    vendor = route.vendor
    provider = vendor.name if vendor is not None else endpoint.name.split(".")[0]
    # the rate windows it takes from, with its money, in the admission's transaction
    rate = claim_of(vendor, provider, estimate.model, credential_of(request), bound)
    facts = CallFacts(
        endpoint.lookup(body), estimate.model, timeout_of(request), digest, bound, rate
    )
    return Metered(
        route,
        endpoint,
        request,
        body,
        estimate,
        digest,
        position_label(endpoint.name),
        streamed,
        hidden_usage,
        facts,
        options.prices,
    )


def _stores_by_default(route: Route) -> bool:
    """Whether the route's vendor keeps such a request unless it says (see
    :meth:`~budget_tasks.providers.Vendor.stores_by_default`)."""
    vendor, endpoint = route.vendor, route.endpoint
    return vendor is not None and endpoint is not None and vendor.stores_by_default(endpoint)


def addressed(m: Metered, provider_key: str) -> httpx2.Request:
    """The request as sent: under the attempt's provider key; a stored chat completion
    also carries it, and the request's digest, in its metadata, so reconciliation finds
    it when its answer never arrived and adopts it only for the same request."""
    request = m.request
    vendor = m.route.vendor
    marked = None
    if vendor is not None:
        marked = vendor.marked_for_lookup(m.endpoint, m.body, provider_key, m.digest)
    if marked is not None:
        request = with_body(request, marked)
    request.headers["Idempotency-Key"] = provider_key
    return request


def request_id_of(response: httpx2.Response) -> str | None:
    return response.headers.get("x-request-id") or response.headers.get("request-id")


def stored_answer(m: Metered, response: httpx2.Response, content: bytes) -> dict[str, Any]:
    """What is kept of an answer for replay (its body as text, or base64 for audio)."""
    kept = {
        "v": STORED_VERSION,
        "request": m.digest,
        "status": response.status_code,
        "headers": [[k, v] for k, v in response.headers.items() if k.lower() in KEPT_HEADERS],
    }
    if m.endpoint.answer == "bytes" and response.status_code < 400:
        return {**kept, "body_b64": base64.b64encode(content).decode("ascii")}
    return {**kept, "body": content.decode("utf-8", errors="replace")}


def rebuilt(response: httpx2.Response, content: bytes, request: httpx2.Request) -> httpx2.Response:
    """The answer handed to the SDK: the decoded body, without the headers of the
    encoded one."""
    return httpx2.Response(
        response.status_code,
        headers=[*decoded_headers(response.headers), ("content-length", str(len(content)))],
        content=content,
        request=request,
        extensions={k: v for k, v in response.extensions.items() if k != "network_stream"},
    )


def decoded_headers(headers: httpx2.Headers) -> list[tuple[str, str]]:
    """A provider's response headers for the body the transport hands on, which it has
    decoded: without Content-Encoding (the SDK would decode it a second time) and
    without the length of the encoded body."""
    dropped = ("content-encoding", "content-length")
    return [(k, v) for k, v in headers.items() if k.lower() not in dropped]


def sent_of(m: Metered, request_id: str | None, content: bytes, stored: dict[str, Any]) -> Sent:
    """What a whole (not streamed) answer reports, priced; usage None while it has none
    (a background Response, a batch: reconciliation reads it)."""
    answer: Any = None
    if m.endpoint.answer == "json":
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
    reported = m.endpoint.usage(answer, m.body)
    response_id = answer.get("id") if isinstance(answer, Mapping) else None
    return _sent(m, request_id, reported, response_id, stored)


def sent_of_stream(
    m: Metered, request_id: str | None, events: Sequence[Mapping[str, Any]], stored: dict[str, Any]
) -> Sent | None:
    """What a stream's events report, priced; None if its usage never arrived."""
    assert m.endpoint.stream_usage is not None
    reported = m.endpoint.stream_usage(events, m.body)
    if reported is None:
        return None
    return _sent(m, request_id, reported, None, stored)


def _sent(
    m: Metered,
    request_id: str | None,
    reported: Reported | None,
    response_id: str | None,
    stored: dict[str, Any],
) -> Sent:
    bound = m.facts.bound  # what prepare() counted, written with the admission too
    if reported is None:
        return Sent(
            m.provider,
            m.estimate.model,
            request_id,
            response_id,
            None,
            None,
            stored,
            bound=bound,
            credential=m.credential,
        )
    cost = reported.cost(m.prices, m.price_provider, datetime.now(UTC))
    model = reported.parts[0].model if reported.parts else m.estimate.model
    # what the vendor's rate limits count it as: what it took and this does not, back
    counted = (m.route.vendor or Vendor()).rate_counted(reported.usage, bound)
    return Sent(
        m.provider,
        model or m.estimate.model,
        request_id,
        reported.response_id or response_id,
        reported.usage,
        cost,
        stored,
        bound=bound,
        credential=m.credential,
        tokens_reported=m.endpoint.tokens_reported,
        rate_counted=counted,
    )


def sse_events(content: bytes) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream, in order."""
    events = []
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
        if isinstance(event, dict):
            events.append(event)
    return events


def without_usage_chunk(content: bytes) -> bytes:
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


def replayed(
    operation: str, call: Any, digest: str, request: httpx2.Request, streamed: bool
) -> httpx2.Response:
    """The stored answer at this position, handed back instead of sending; a different
    request there is CallConflict, a billed call with nothing replayable stored is
    StepNotReplayable."""
    stored = call.result
    if call.reconciled and isinstance(stored, dict) and isinstance(stored.get("response"), dict):
        if streamed:
            raise StepNotReplayable(operation, call.key)  # no events were kept
        found_for = stored.get("request")
        if found_for is not None and found_for != digest:
            raise CallConflict(operation, call.key)
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
        raise StepNotReplayable(operation, call.key)
    if stored["request"] != digest:
        raise CallConflict(operation, call.key)
    if "body_b64" in stored:
        content = base64.b64decode(stored["body_b64"])
    else:
        content = str(stored["body"]).encode()
    headers = [(k, v) for k, v in stored["headers"] if k.lower() != "content-length"]
    return httpx2.Response(
        int(stored["status"]),
        headers=[*headers, ("content-length", str(len(content)))],
        content=content,
        request=request,
    )


def with_body(request: httpx2.Request, body: dict[str, Any]) -> httpx2.Request:
    content = json.dumps(body).encode()
    headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
    return httpx2.Request(
        request.method,
        request.url,
        headers=headers,
        content=content,
        extensions=request.extensions,
    )


def timeout_of(request: httpx2.Request) -> float | None:
    """The longest the client waits for this request (its timeout's parts added up);
    ``math.inf`` when any part is unbounded (the provider may work on it for ever);
    None when the request says nothing of it."""
    parts = list((request.extensions.get("timeout") or {}).values())
    if not parts:
        return None
    if any(p is None for p in parts):
        return math.inf
    finite = [float(p) for p in parts if isinstance(p, int | float)]
    return sum(finite) if finite else None
