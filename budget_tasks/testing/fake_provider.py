"""A fake LLM provider that speaks the OpenAI and Anthropic HTTP APIs as the real ones do,
for the official SDKs to use unchanged, and bills every request it serves.

Run it in a thread (``FakeProvider().start()``) or as a process::

    budget-tasks fake-provider --port 8089     # or: python -m budget_tasks.testing

OpenAI clients use ``base_url=<url>/v1``; Anthropic clients use ``base_url=<url>``.

Endpoints: ``POST /v1/chat/completions`` (plain and streamed, ``store`` + ``metadata``),
``GET /v1/chat/completions/{id}`` and ``GET /v1/chat/completions?metadata[k]=v``,
``POST /v1/responses`` (``background``, streamed) and ``GET /v1/responses/{id}``,
``POST /v1/embeddings``, ``POST /v1/completions`` (legacy), ``POST
/v1/images/generations``, ``POST /v1/audio/speech``, ``POST /v1/messages`` (plain and
streamed), ``POST /v1/messages/count_tokens``, ``POST /v1/messages/batches``, ``GET
/v1/messages/batches/{id}`` and ``.../results``.

Organisation reports, for an admin key only (``sk-admin-...`` / ``sk-ant-admin...``;
any other key gets 401), built from what the fake billed (:mod:`.fake_reports`): OpenAI
``GET /v1/organization/usage/completions`` and ``.../usage/embeddings``, ``GET
/v1/organization/costs``, ``GET /v1/organization/projects``, ``GET`` and ``DELETE``
``.../projects/{id}/api_keys`` (a key deleted); Anthropic ``GET
/v1/organizations/usage_report/messages``, ``GET /v1/organizations/cost_report``, ``GET
/v1/organizations/api_keys`` and ``POST .../api_keys/{id}`` (a key's status). Each
request is recorded with the id and project of the key that sent it (``Authorization:
Bearer`` or ``x-api-key``; OpenAI's ``OpenAI-Project`` header names another project):
keys are registered with ``add_key()``, or on first use in the default project; a key
deleted, archived or inactive is refused (401), as the real APIs refuse it. Reports
lag ``report_delay`` seconds behind, as the real ones do, and place each request at
``clock()`` (the real time, unless a test sets a clock of its own).

As the real APIs (each can be turned off with ``realism``, :class:`Realism`): answers
are compressed in the first of br, gzip, zstd and deflate that the client's
``Accept-Encoding`` names, streams flushed event by event; answers name the snapshot
(``gpt-4o-mini`` is answered by ``gpt-4o-mini-2024-07-18``); each vendor's request-id
and rate-limit headers (``retry-after`` on a 429); reasoning models report reasoning
tokens; Anthropic bills ``cache_control`` prefixes as cache writes (5 minutes, or 1 hour)
and then reads, split by TTL in ``cache_creation``; the service tier asked for bills
(and the answer names it); a batch bills half; items stored at the provider that a
request points at (``item_reference``) and media inside tool results bill.

Tools: a (non-streamed) chat completion or message whose request carries tools and
ends with the user's own message asks for the first tool (``tool_calls`` /
``tool_use``); after a tool result the answer is text: a tool round trip.

Billing is deterministic: a text costs ``ceil(utf8 bytes / 4) + 4`` input tokens, a
request 3 more, an image 765, a stored item 6,000; output tokens are
``x-fake-output-tokens`` if given, else ``min(max tokens, 12 + input tokens % 17)``.
Each served request is billed at this package's prices (the maintained source: real
list prices, snapshots, tiers, cache and batch rates); unknown models get 404 and no
bill. ``x-fake-cached-tokens`` and ``x-fake-reasoning-tokens`` set those counts.

Rate limits (:mod:`.fake_limits`), off until set with ``set_limits()``, ``POST
/_fake/limits`` or on the command line (``--limit openai:gpt-4o-mini:requests=600``,
repeatable; several kinds at once: ``requests=600,tokens=60000``): per vendor and
model, requests and tokens a minute (Anthropic's input and output tokens apart) in
buckets that refill continuously, counted as each vendor counts them; a request that
does not fit is answered 429 in its vendor's shape (``retry-after``), not billed, and
every answer of a limited model carries the vendor's rate-limit headers read from the
buckets.

Faults, per request in the ``x-fake-fault`` header or queued with ``plan()`` /
``POST /_fake/faults``: ``status=NNN`` (an error, not billed; 429 with ``retry-after``,
529 Anthropic's overloaded), ``delay=S`` (answer after S seconds), ``hang=S`` (bill,
then answer only after S seconds: the client times out), ``reset`` (bill, then close
the connection without an answer), ``cut-stream`` (bill, send part of the stream, then
cut the connection).

State for tests: ``GET /_fake/state`` (or ``.state()``), ``POST /_fake/reset``, ``POST
/_fake/reports`` (``{"delay": seconds}``), ``POST /_fake/keys`` (``{"secret", "project",
"vendor", "owner_access"}``: the key's id), ``POST /_fake/limits`` (``set_limits()``'s
arguments, or ``{"clear": true}``) and ``DELETE /_fake/limits``; in a thread,
``tamper_next_report`` spoils the next admin answer (a test's unreadable report).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .. import bypass
from ..pricing import Prices, Usage, default_prices
from ..pricing.usage import PriceContext
from . import fake_answers as answers
from . import fake_limits, fake_wire
from . import fake_reports as reports
from .fake_billing import (
    SNAPSHOTS,
    PromptCache,
    Realism,
    context_of,
    prompt_tokens,
    reasoning_tokens,
    snapshot,
    text_tokens,
    tier_of,
)

#: Kept for callers of the old names.
message_tokens = text_tokens

CONTROL = "/_fake"
#: The admin writes the fake serves: OpenAI deletes a project's key, Anthropic changes
#: a key's status (both with an admin key, as the real APIs).
_ADMIN_WRITES = {("DELETE", "projects"), ("POST", "api_keys")}
METADATA_PREFIX = "metadata["
#: Output tokens of one image, by size and quality (what the fake bills; "auto" is
#: answered with a 1024x1024 image at medium quality).
IMAGE_OUTPUT_TOKENS = {
    "1024x1024": {"low": 272, "medium": 1056, "high": 4160},
    "1024x1536": {"low": 408, "medium": 1584, "high": 6240},
    "1536x1024": {"low": 400, "medium": 1568, "high": 6208},
}


@dataclass
class Served:
    """One request as the provider saw it."""

    seq: int
    method: str
    path: str
    model: str | None
    idempotency_key: str | None
    body_sha: str
    request_id: str
    status: int
    fault: str | None
    billed: int
    usage: dict[str, int] | None
    at: float
    #: the Content-Encoding the answer went out in
    encoding: str = "identity"
    #: the model that answered (a snapshot of the one asked for)
    answered_by: str | None = None
    #: "openai" or "anthropic": whose API the request spoke
    vendor: str = reports.OPENAI
    #: the id and project of the API key that sent it (never the key)
    key_id: str | None = None
    project: str | None = None
    #: what each model's work was billed (a batch bills several)
    bills: list[reports.Bill] = field(default_factory=list)


@dataclass
class _Job:
    """A background response or a batch, finished once ``ready_at`` has passed."""

    kind: str
    id: str
    created_at: float
    ready_at: float
    model: str
    payload: dict[str, Any] = field(default_factory=dict)


def _tool_to_call(body: dict[str, Any], *, anthropic: bool) -> str | None:
    """The tool a request's answer calls: its first function tool, when the last message
    is the user's own (after a tool result, the answer is text)."""
    tools = body.get("tools") or []
    messages = body.get("messages") or []
    if not tools or not messages:
        return None
    last = messages[-1]
    if last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content
    ):
        return None
    first = tools[0]
    name = first.get("name") if anthropic else (first.get("function") or {}).get("name")
    return str(name) if name else None


def _tool_arguments(body: dict[str, Any], *, anthropic: bool) -> dict[str, Any]:
    """Arguments for the first tool, as a model gives them: every ``required`` property
    of its schema, with a value of the property's type (its first ``enum`` value, if
    it has one)."""
    first = (body.get("tools") or [{}])[0]
    schema = (
        first.get("input_schema") if anthropic else (first.get("function") or {}).get("parameters")
    )
    return _value_for(schema) if isinstance(schema, dict) else {}


def _value_for(schema: dict[str, Any]) -> Any:
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        return {
            name: _value_for(properties.get(name) or {}) for name in schema.get("required") or []
        }
    simple = {"integer": 1, "number": 1.0, "boolean": True, "array": [], "null": None}
    return simple.get(str(kind), "fake")


def _extras(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: body[name] for name in names if body.get(name) is not None}


class FakeProvider:
    """The fake provider server. Use as a context manager or ``start()``/``stop()``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        prices: Prices | None = None,
        realism: Realism | None = None,
    ) -> None:
        self.prices: Prices = prices or default_prices()
        self._default_realism = realism or Realism()
        #: Which of the real APIs' ways the fake follows (see :class:`Realism`).
        self.realism = self._default_realism
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._served: list[Served] = []
        self._faults: list[dict[str, Any]] = []
        self._completions: dict[str, dict[str, Any]] = {}
        self._jobs: dict[str, _Job] = {}
        self.cache = PromptCache()
        #: Content encodings the answers go out in when the client accepts them: "auto"
        #: (every one this fake can make, as the real APIs compress), or an order of
        #: names; () answers uncompressed.
        self.encodings: tuple[str, ...] | str = "auto"
        #: Stored chat completions: "on" (as requested by ``store``), "off" (nothing is
        #: stored, as with zero data retention) or "no-route" (the lookup routes 404).
        self.completion_storage = "on"
        #: Called with each billed POST's record just before its answer goes out (a
        #: test's way to make something happen after the provider billed and before
        #: the caller knows: a ledger outage, a kill).
        self.before_answer: Callable[[Served], None] | None = None
        #: Seconds a billed request takes to show in the usage and cost reports.
        self.report_delay = 0.0
        #: When a request arrives, in unix seconds, as the reports place it (a test's
        #: own clock, shared with its ledger's, to send in any minute it likes).
        self.clock: Callable[[], float] = time.time
        #: Test-only: called once with the next admin answer's JSON (a report page or a
        #: key list) to change it before it goes out (an unreadable count, say).
        self.tamper_next_report: Callable[[dict[str, Any]], None] | None = None
        #: The organisation's API keys (:meth:`add_key`).
        self.keys = reports.Keys()
        #: The rate limits (:meth:`set_limits`).
        self.limits = fake_limits.Limiter()
        self._server = _Server((host, port), _handler_for(self))
        address = self._server.server_address
        self.host: str = str(address[0])
        self.port: int = int(address[1])
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> FakeProvider:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        bypass.forget(self.url)  # its port is free for anything now

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- control ---------------------------------------------------------------------

    def plan(self, fault: str, *, count: int = 1, path: str | None = None) -> None:
        """Apply ``fault`` to the next ``count`` matching requests (path substring)."""
        _parse_fault(fault)
        with self._lock:
            self._faults.append({"fault": fault, "count": count, "path": path})

    def add_key(
        self,
        secret: str,
        *,
        project: str | None = None,
        vendor: str = reports.OPENAI,
        owner_access: str = "active",
    ) -> str:
        """Register an API key in ``project`` (None: the default project, or Anthropic's
        default workspace) and return its id; a key already known moves there.
        ``owner_access="inactive"``: an OpenAI key whose owner has no access to its
        project any more (it works; the project's list leaves it out unless asked)."""
        return self.keys.add(secret, vendor, project, owner_access=owner_access).id

    def set_limits(
        self,
        vendor: str,
        model: str = fake_limits.ANY_MODEL,
        *,
        requests: int | None = None,
        tokens: int | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """Rate-limit ``vendor``'s ``model`` (as asked; "*": one quota shared by its models
        without limits of their own), per minute; None leaves that one unlimited, and
        all None removes the model's limits. Anthropic alone has input and output
        token limits. See :mod:`.fake_limits`."""
        self.limits.set(
            vendor,
            model,
            requests=requests,
            tokens=tokens,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
        )

    def clear_limits(self) -> None:
        """Remove every rate limit."""
        self.limits.clear()

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted (``budget-tasks fake-provider``)."""
        self._server.serve_forever()

    def reset(self) -> None:
        """Forget every request, job and planned fault, every key (registered with
        :meth:`add_key` or seen) and every rate limit: a test starts with an empty
        organisation."""
        with self._lock:
            self.completion_storage = "on"
            self.encodings = "auto"
            self.realism = self._default_realism
            self.before_answer = None
            self.report_delay = 0.0
            self.clock = time.time
            self.tamper_next_report = None
            self._served.clear()
            self._faults.clear()
            self._completions.clear()
            self._jobs.clear()
        self.cache.clear()
        self.keys.clear()
        self.limits.reset()

    def served(self) -> list[Served]:
        with self._lock:
            return list(self._served)

    def state(self) -> dict[str, Any]:
        """Requests served, counts per Idempotency-Key and per body, total billed, the
        rate limits set and how many requests they refused."""
        with self._lock:
            served = [asdict(s) for s in self._served]
        return {
            "requests": served,
            "by_key": dict(Counter(s["idempotency_key"] for s in served if s["idempotency_key"])),
            "by_body": dict(Counter(s["body_sha"] for s in served if s["method"] == "POST")),
            "billed_total": sum(s["billed"] for s in served),
            "limits": self.limits.configured(),
            "rate_limited": self.limits.refused,
        }

    def billed_for(self, key: str, ledger: Any = None) -> int:
        """What the requests carrying this Idempotency-Key were billed; with ``ledger``,
        ``key`` is that ledger's attempt key (the provider is sent its provider key)."""
        if ledger is not None:
            key = ledger.provider_key(key)
        return sum(s.billed for s in self.served() if s.idempotency_key == key)

    def served_as(self, ledger: Any) -> list[Served]:
        """The requests served, each Idempotency-Key given back as ``ledger``'s attempt
        key: the provider is sent an opaque digest of it
        (:meth:`~budget_tasks.Ledger.provider_key`). A key the ledger does not know
        stays as it was sent."""
        keys = {ledger.provider_key(a.key): a.key for a in ledger.attempts()}
        return [
            replace(s, idempotency_key=keys.get(s.idempotency_key or "", s.idempotency_key))
            for s in self.served()
        ]

    # -- internals used by the handler -------------------------------------------------

    def _reportable(self) -> list[Served]:
        """The billed requests old enough to be in a report (reports lag)."""
        cutoff = self.clock() - self.report_delay
        return [s for s in self.served() if s.bills and s.at <= cutoff]

    def _next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}"

    def _take_fault(self, path: str, header: str | None) -> str | None:
        if header:
            return header
        with self._lock:
            for planned in self._faults:
                if planned["path"] is None or planned["path"] in path:
                    planned["count"] -= 1
                    if planned["count"] <= 0:
                        self._faults.remove(planned)
                    return str(planned["fault"])
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out or was cut off is part of the job, not an error.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


def _parse_fault(fault: str) -> tuple[str, float]:
    name, _, value = fault.partition("=")
    name = name.strip()
    if name not in ("status", "delay", "hang", "reset", "cut-stream"):
        raise ValueError(f"unknown fault {fault!r}")
    return name, float(value) if value else 0.0


def _handler_for(provider: FakeProvider) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        fake = provider

    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as a real provider's front end has: an answer goes out in two writes
    # (headers, then body), and with Nagle on the second waits for the client's delayed
    # ACK, ~40 ms per request.
    disable_nagle_algorithm = True
    fake: FakeProvider
    #: the request being answered (None for the control routes)
    _record: Served | None = None
    _stream: fake_wire.Encoder = fake_wire.encoder("identity")
    _anthropic = False
    #: what the rate limits decided for the request (None: no limit applies)
    _rate: fake_limits.Admission | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- plumbing --------------------------------------------------------------------

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _encoding(self) -> str:
        if not self.fake.realism.compress:
            return "identity"
        return fake_wire.choose(self.headers.get("Accept-Encoding"), self.fake.encodings)

    def _ids(self, request_id: str) -> None:
        """The request id and rate-limit headers, as this request's vendor sends them."""
        if not self.fake.realism.headers:
            self.send_header("x-request-id", request_id)
            self.send_header("request-id", request_id)
            return
        if self._anthropic:
            self.send_header("request-id", request_id)
        else:
            self.send_header("x-request-id", request_id)
            self.send_header("openai-processing-ms", "3")
        rate = self._rate
        limits = (
            self.fake.limits.headers(rate)
            if rate is not None
            else fake_limits.unlimited_headers(self._anthropic)
        )
        for name, value in limits:
            self.send_header(name, value)

    def _send_json(self, status: int, obj: Any, request_id: str) -> None:
        self._send_bytes(status, json.dumps(obj).encode(), request_id, "application/json")

    def _send_bytes(
        self,
        status: int,
        raw: bytes,
        request_id: str,
        content_type: str,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        name = self._encoding()
        body = fake_wire.encode_whole(name, raw)
        if self._record is not None:
            self._record.encoding = name
            hook = self.fake.before_answer
            if hook is not None and status < 400 and self._record.method == "POST":
                hook(self._record)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if name != "identity":
            self.send_header("Content-Encoding", name)
        self.send_header("Content-Length", str(len(body)))
        if request_id != "control":
            self._ids(request_id)
        for key, value in extra:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _start_stream(self, request_id: str) -> None:
        self._stream = fake_wire.encoder(self._encoding())
        if self._record is not None:
            self._record.encoding = self._stream.name
            hook = self.fake.before_answer
            if hook is not None:
                hook(self._record)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if self._stream.name != "identity":
            self.send_header("Content-Encoding", self._stream.name)
        self.send_header("Transfer-Encoding", "chunked")
        self._ids(request_id)
        self.end_headers()
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        data = self._stream.chunk(data)
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    def _end_stream(self) -> None:
        with contextlib.suppress(OSError):
            tail = self._stream.end()
            if tail:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(tail), tail))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _cut(self) -> None:
        """Close the connection abruptly (RST), mid-answer or before any."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            self.connection.shutdown(socket.SHUT_RDWR)

    def _error(self, status: int, message: str, request_id: str) -> None:
        extra: tuple[tuple[str, str], ...] = ()
        if status in (429, 529) and self.fake.realism.headers:
            extra = (("retry-after", "1"),)
        self._send_bytes(
            status,
            json.dumps(answers.error(status, message, self._anthropic)).encode(),
            request_id,
            "application/json",
            extra,
        )

    # -- routing ---------------------------------------------------------------------

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def _route(self, method: str) -> None:
        self._record = None
        self._rate = None
        raw = self._read_body() if method == "POST" else b""
        parts = urlsplit(self.path)
        path = parts.path.rstrip("/")
        if path.startswith(CONTROL):
            self._control(method, path, raw)
            return
        fake = self.fake
        request_id = fake._next_id("req_")
        self._anthropic = path.startswith(("/v1/messages", "/v1/organizations"))
        vendor = reports.ANTHROPIC if self._anthropic else reports.OPENAI
        if self.headers.get("anthropic-version"):
            vendor = reports.ANTHROPIC
        self._secret = self._key_sent()
        key = None
        refused = False  # a key deleted, or not active: the real APIs answer 401
        if self._secret and not self._secret.startswith(reports.ADMIN_PREFIXES[vendor]):
            key = fake.keys.seen(self._secret, vendor)
            refused = key is None or key.status != "active"
        project = key.project if key is not None else None
        if vendor == reports.OPENAI and self.headers.get("OpenAI-Project"):
            project = self.headers["OpenAI-Project"]
        try:
            body: dict[str, Any] = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        query = parse_qs(parts.query)
        fault = (
            fake._take_fault(path, self.headers.get("x-fake-fault")) if method == "POST" else None
        )
        record = Served(
            seq=0,
            method=method,
            path=path,
            model=body.get("model") if isinstance(body.get("model"), str) else None,
            idempotency_key=self.headers.get("Idempotency-Key"),
            body_sha=hashlib.sha256(raw).hexdigest()[:16],
            request_id=request_id,
            status=200,
            fault=fault,
            billed=0,
            usage=None,
            at=fake.clock(),
            vendor=vendor,
            key_id=key.id if key is not None else None,
            project=project,
        )
        # Recorded on arrival: a request still running (a hang) shows up at once, and one
        # that outlives a reset() does not leak into the next test's record.
        with fake._lock:
            record.seq = len(fake._served) + 1
            fake._served.append(record)
        self._record = record
        try:
            if refused:
                record.status = 401
                self._error(401, "Incorrect API key provided (deleted or not active)", request_id)
                return
            if fault:
                name, value = _parse_fault(fault)
                if name == "status":
                    record.status = int(value)
                    self._error(int(value), f"fake {int(value)}", request_id)
                    return
                if name == "delay":
                    time.sleep(value)
            handler = self._endpoint(method, path)
            if handler is None:
                record.status = 404
                self._error(404, f"no route {method} {path}", request_id)
                return
            handler(record, body, query)
        except OSError:
            record.status = record.status if record.status != 200 else 0  # the client left

    def _key_sent(self) -> str | None:
        """The API key the request carries (a bearer token, or Anthropic's header)."""
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return self.headers.get("x-api-key") or None

    def _endpoint(self, method: str, path: str) -> Any:
        segments = path.split("/")[1:]
        if segments[1:2] in (["organization"], ["organizations"]) and (
            method == "GET" or (method, "".join(segments[2:3])) in _ADMIN_WRITES
        ):
            return lambda r, b, q: self._admin(r, segments, q, b)
        routes: dict[tuple[str, ...], Any] = {
            ("POST", "v1", "chat", "completions"): self._chat,
            ("GET", "v1", "chat", "completions"): self._chat_list,
            ("POST", "v1", "responses"): self._responses_create,
            ("POST", "v1", "embeddings"): self._embeddings,
            ("POST", "v1", "completions"): self._completions,
            ("POST", "v1", "images", "generations"): self._images,
            ("POST", "v1", "audio", "speech"): self._speech,
            ("POST", "v1", "messages"): self._messages,
            ("POST", "v1", "messages", "count_tokens"): self._count_tokens,
            ("POST", "v1", "messages", "batches"): self._batch_create,
        }
        stored = self.fake.completion_storage != "no-route"
        if method == "GET" and segments[:3] == ["v1", "chat", "completions"] and not stored:
            return None
        found = routes.get((method, *segments))
        if found:
            return found
        if method == "GET" and segments[:2] == ["v1", "models"] and len(segments) <= 3:
            return lambda r, b, q: self._models(r, segments[2] if len(segments) == 3 else None)
        if method == "GET" and segments[:3] == ["v1", "chat", "completions"] and len(segments) == 4:
            return lambda r, b, q: self._chat_get(r, segments[3])
        if method == "GET" and segments[:2] == ["v1", "responses"] and len(segments) == 3:
            return lambda r, b, q: self._responses_get(r, segments[2])
        if method == "GET" and segments[:3] == ["v1", "messages", "batches"]:
            if len(segments) == 4:
                return lambda r, b, q: self._batch_get(r, segments[3])
            if len(segments) == 5 and segments[4] == "results":
                return lambda r, b, q: self._batch_results(r, segments[3])
        return None

    def _admin(
        self,
        record: Served,
        segments: list[str],
        query: dict[str, list[str]],
        body: dict[str, Any] | None = None,
    ) -> None:
        """An organisation report or key list (:mod:`.fake_reports`): refused (401) for
        any key but an admin key, as the real APIs refuse a project's key."""
        prefix = reports.ADMIN_PREFIXES[record.vendor]
        if not (self._secret or "").startswith(prefix):
            record.status = 401
            self._error(401, f"this endpoint needs an admin key ({prefix}...)", record.request_id)
            return
        try:
            answer = reports.admin_answer(
                segments,
                query,
                self.fake.keys,
                self.fake._reportable,
                method=record.method,
                body=body,
            )
        except reports.ReportError as exc:
            record.status = exc.status
            self._error(exc.status, str(exc), record.request_id)
            return
        with self.fake._lock:
            tamper, self.fake.tamper_next_report = self.fake.tamper_next_report, None
        if tamper is not None:
            tamper(answer)
        self._send_json(200, answer, record.request_id)

    def _models(self, record: Served, model_id: str | None) -> None:
        """The models this fake answers for, as each vendor lists them (the Anthropic
        SDK sends an ``anthropic-version`` header); one model by its id."""
        anthropic = self.headers.get("anthropic-version") is not None
        names = sorted({*SNAPSHOTS, *SNAPSHOTS.values()})
        names = [n for n in names if n.startswith("claude") == anthropic]

        def entry(name: str) -> dict[str, Any]:
            if anthropic:
                return {
                    "type": "model",
                    "id": name,
                    "display_name": name,
                    "created_at": "2025-01-01T00:00:00Z",
                }
            return {"id": name, "object": "model", "created": 1735689600, "owned_by": "openai"}

        if model_id is not None:
            if model_id not in names:
                record.status = 404
                self._error(404, f"The model {model_id!r} does not exist", record.request_id)
                return
            self._send_json(200, entry(model_id), record.request_id)
            return
        listed = [entry(n) for n in names]
        if anthropic:
            page = {"data": listed, "has_more": False, "first_id": names[0], "last_id": names[-1]}
            self._send_json(200, page, record.request_id)
        else:
            self._send_json(200, {"object": "list", "data": listed}, record.request_id)

    def _control(self, method: str, path: str, raw: bytes) -> None:
        fake = self.fake
        if method == "GET" and path == f"{CONTROL}/state":
            self._send_json(200, fake.state(), "control")
        elif method == "POST" and path == f"{CONTROL}/faults":
            spec = json.loads(raw)
            fake.plan(spec["fault"], count=int(spec.get("count", 1)), path=spec.get("path"))
            self._send_json(200, {"ok": True}, "control")
        elif method == "POST" and path == f"{CONTROL}/reset":
            fake.reset()
            self._send_json(200, {"ok": True}, "control")
        elif method == "POST" and path == f"{CONTROL}/reports":
            fake.report_delay = float(json.loads(raw).get("delay", 0))
            self._send_json(200, {"ok": True}, "control")
        elif method in ("POST", "DELETE") and path == f"{CONTROL}/limits":
            spec = json.loads(raw) if raw else {}
            try:
                if method == "DELETE" or spec.pop("clear", False):
                    fake.clear_limits()
                else:
                    fake.set_limits(**spec)
            except (TypeError, ValueError) as exc:
                self._send_json(400, {"error": str(exc)}, "control")
                return
            self._send_json(200, {"limits": fake.limits.configured()}, "control")
        elif method == "POST" and path == f"{CONTROL}/keys":
            spec = json.loads(raw)
            vendor = spec.get("vendor", reports.OPENAI)
            key_id = fake.add_key(
                spec["secret"],
                project=spec.get("project"),
                vendor=vendor,
                owner_access=spec.get("owner_access", "active"),
            )
            self._send_json(200, {"id": key_id}, "control")
        else:
            self._send_json(404, {"error": "unknown control path"}, "control")

    # -- billing ---------------------------------------------------------------------

    @property
    def _provider(self) -> str:
        return "anthropic" if self._anthropic else "openai"

    def _answered_by(self, model: Any) -> str | None:
        """The snapshot that answers for ``model``; None for a model without a price."""
        if not isinstance(model, str) or not model:
            return None
        answered = snapshot(model, self.fake.realism)
        prices = self.fake.prices
        if prices.knows(answered, self._provider):
            return answered
        return model if prices.knows(model, self._provider) else None

    def _header_int(self, name: str) -> int | None:
        value = self.headers.get(name)
        return int(value) if value else None

    def _output(self, input_tokens: int, limit: int | None) -> int:
        limit = fake_limits.output_bound(limit)
        wanted = self._header_int("x-fake-output-tokens")
        return min(limit, wanted) if wanted is not None else min(limit, 12 + input_tokens % 17)

    def _tokens(self, model: str, input_tokens: int, limit: int | None) -> Usage:
        """One answer's usage: cached tokens as asked, reasoning tokens as a reasoning
        model reports them."""
        output = self._output(input_tokens, limit)
        cached = min(input_tokens, self._header_int("x-fake-cached-tokens") or 0)
        reasoning = reasoning_tokens(
            model, output, self._header_int("x-fake-reasoning-tokens"), self.fake.realism
        )
        return Usage(
            input_tokens=input_tokens - cached,
            cached_input_tokens=cached,
            output_tokens=output,
            reasoning_tokens=reasoning,
        )

    def _bill(
        self, record: Served, model: str, usage: Usage, context: PriceContext | None = None
    ) -> int:
        context = context or PriceContext()
        prices = self.fake.prices
        billed = prices.cost(model, usage, provider=self._provider, context=context)
        record.billed += billed
        record.answered_by = model
        record.usage = {k: v for k, v in asdict(usage).items() if v}
        record.bills.append(reports.bill_of(prices, self._provider, model, usage, context, billed))
        return billed

    def _admit(self, record: Served, ask: fake_limits.Ask) -> bool:
        """Take what the request counts from its rate limits; False when they refuse it
        (answered 429, and not billed)."""
        limits = self.fake.limits
        self._rate = limits.admit(record.vendor, record.model, ask)
        if self._rate is None or self._rate.refused is None:
            return True
        record.status = 429
        body, retry = limits.refusal(self._rate)
        extra = tuple(retry) if self.fake.realism.headers else ()
        self._send_bytes(
            429, json.dumps(body).encode(), record.request_id, "application/json", extra
        )
        return False

    def _unknown_model(self, record: Served, model: Any) -> None:
        record.status = 404
        self._error(404, f"The model {model!r} does not exist", record.request_id)

    def _after_billing(self, record: Served) -> bool:
        """Apply hang/reset faults once the work is billed; True if the answer is gone."""
        if record.fault is None:
            return False
        name, value = _parse_fault(record.fault)
        if name == "hang":
            time.sleep(value)
            return False
        if name == "reset":
            record.status = 0
            self._cut()
            return True
        return False

    def _sse(self, record: Served, events: list[bytes], cut_at: int) -> None:
        self._start_stream(record.request_id)
        try:
            for i, event in enumerate(events):
                if record.fault == "cut-stream" and i == cut_at:
                    self._cut()
                    return
                self._chunk(event)
            self._end_stream()
        except OSError:
            return

    # -- OpenAI chat completions -------------------------------------------------------

    def _chat(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = self._answered_by(body.get("model"))
        if model is None:
            self._unknown_model(record, body.get("model"))
            return
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        extras = _extras(body, ("tools", "functions", "tool_choice", "response_format"))
        input_tokens = prompt_tokens(body.get("messages", []), None, extras, self.fake.realism)
        n = body.get("n") or 1
        if not self._admit(record, fake_limits.openai_ask(input_tokens, max_tokens, n)):
            return
        each = self._tokens(model, input_tokens, max_tokens)
        # Output is billed per choice: n choices of the same length here.
        usage = Usage(
            input_tokens=each.input_tokens,
            cached_input_tokens=each.cached_input_tokens,
            output_tokens=each.output_tokens * n,
            reasoning_tokens=each.reasoning_tokens * n,
        )
        tier = tier_of(body.get("service_tier"), self.fake.realism)
        self._bill(record, model, usage, context_of(tier))
        completion = answers.chat_completion(
            self.fake._next_id("chatcmpl-"),
            model,
            usage,
            each.output_tokens,
            n,
            max_tokens,
            body.get("metadata") or {},
            tier,
        )
        tool = _tool_to_call(body, anthropic=False)
        if tool is not None and not body.get("stream"):
            # a request with tools whose last message is the user's: the model asks for
            # the first tool (a tool result after it gets text): a tool round trip
            for choice in completion["choices"]:
                choice["message"] = {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": self.fake._next_id("call_"),
                            "type": "function",
                            "function": {
                                "name": tool,
                                "arguments": json.dumps(_tool_arguments(body, anthropic=False)),
                            },
                        }
                    ],
                }
                choice["finish_reason"] = "tool_calls"
        if body.get("store") and self.fake.completion_storage == "on":
            with self.fake._lock:
                self.fake._completions[completion["id"]] = completion
        if self._after_billing(record):
            return
        if not body.get("stream"):
            self._send_json(200, completion, record.request_id)
            return
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = answers.chat_chunks(completion, with_usage)
        events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
        self._sse(record, [*events, b"data: [DONE]\n\n"], cut_at=2)

    def _chat_get(self, record: Served, completion_id: str) -> None:
        with self.fake._lock:
            completion = self.fake._completions.get(completion_id)
        if completion is None:
            record.status = 404
            self._error(404, f"No chat completion found with id {completion_id}", record.request_id)
            return
        self._send_json(200, completion, record.request_id)

    def _chat_list(self, record: Served, body: Any, query: dict[str, list[str]]) -> None:
        wanted = {
            k[len(METADATA_PREFIX) : -1]: v[0]
            for k, v in query.items()
            if k.startswith(METADATA_PREFIX) and k.endswith("]")
        }
        with self.fake._lock:
            found = [
                c
                for c in self.fake._completions.values()
                if all(c["metadata"].get(k) == v for k, v in wanted.items())
            ]
        if query.get("limit"):
            found = found[: int(query["limit"][0])]
        self._send_json(
            200,
            {
                "object": "list",
                "data": found,
                "first_id": found[0]["id"] if found else None,
                "last_id": found[-1]["id"] if found else None,
                "has_more": False,
            },
            record.request_id,
        )

    # -- OpenAI Responses --------------------------------------------------------------

    def _responses_create(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = self._answered_by(body.get("model"))
        if model is None:
            self._unknown_model(record, body.get("model"))
            return
        extras = _extras(body, ("tools", "tool_choice", "text"))
        input_tokens = prompt_tokens(
            body.get("input", ""), body.get("instructions"), extras, self.fake.realism
        )
        if not self._admit(
            record, fake_limits.openai_ask(input_tokens, body.get("max_output_tokens"))
        ):
            return
        usage = self._tokens(model, input_tokens, body.get("max_output_tokens"))
        tier = tier_of(body.get("service_tier"), self.fake.realism)
        self._bill(record, model, usage, context_of(tier))
        work = float(self.headers.get("x-fake-work-seconds") or 0)
        background = bool(body.get("background"))
        job = _Job(
            "response",
            self.fake._next_id("resp_"),
            time.time(),
            time.time() + work,
            model,
            {"usage": usage, "background": background, "tier": tier},
        )
        with self.fake._lock:
            self.fake._jobs[job.id] = job
        if self._after_billing(record):
            return
        answer = answers.response_object(
            job.id,
            job.created_at,
            model,
            usage,
            done=not background,
            background=background,
            tier=tier,
        )
        if not body.get("stream"):
            self._send_json(200, answer, record.request_id)
            return
        created = {**answer, "status": "in_progress", "output": [], "usage": None}
        events = [
            ("response.created", {"type": "response.created", "response": created}),
            (
                "response.output_text.delta",
                {"type": "response.output_text.delta", "delta": "fake ", "output_index": 0},
            ),
            ("response.completed", {"type": "response.completed", "response": answer}),
        ]
        self._sse(
            record,
            [f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in events],
            cut_at=1,
        )

    def _responses_get(self, record: Served, response_id: str) -> None:
        with self.fake._lock:
            job = self.fake._jobs.get(response_id)
        if job is None or job.kind != "response":
            record.status = 404
            self._error(404, f"Response with id '{response_id}' not found.", record.request_id)
            return
        answer = answers.response_object(
            job.id,
            job.created_at,
            job.model,
            job.payload["usage"],
            done=time.time() >= job.ready_at,
            background=job.payload["background"],
            tier=job.payload["tier"],
        )
        self._send_json(200, answer, record.request_id)

    # -- OpenAI embeddings, legacy completions, images, speech -------------------------

    def _embeddings(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = self._answered_by(body.get("model"))
        if model is None:
            self._unknown_model(record, body.get("model"))
            return
        raw = body.get("input")
        inputs = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
        tokens = sum(
            len(item) if isinstance(item, list) else text_tokens(str(item)) for item in inputs
        )
        if not self._admit(record, fake_limits.Ask(tokens)):
            return
        self._bill(record, model, Usage(input_tokens=tokens))
        if self._after_billing(record):
            return
        self._send_json(200, answers.embeddings(model, len(inputs), tokens), record.request_id)

    def _completions(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = self._answered_by(body.get("model"))
        if model is None:
            self._unknown_model(record, body.get("model"))
            return
        prompt = body.get("prompt", "")
        many = isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
        prompts = prompt if many else [prompt]
        input_tokens = 3 + sum(
            len(p) if isinstance(p, list) else text_tokens(str(p)) for p in prompts
        )
        if body.get("suffix"):
            input_tokens += text_tokens(str(body["suffix"]))
        each = self._output(input_tokens, body.get("max_tokens", 16))
        generated = max(body.get("n") or 1, body.get("best_of") or 1) * len(prompts)
        ask = fake_limits.openai_ask(input_tokens, body.get("max_tokens", 16), generated)
        if not self._admit(record, ask):
            return
        usage = Usage(input_tokens=input_tokens, output_tokens=each * generated)
        self._bill(record, model, usage)
        if self._after_billing(record):
            return
        answer = answers.text_completion(
            self.fake._next_id("cmpl-"), model, usage, each, (body.get("n") or 1) * len(prompts)
        )
        if not body.get("stream"):
            self._send_json(200, answer, record.request_id)
            return
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = answers.text_completion_chunks(answer, with_usage)
        events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
        self._sse(record, [*events, b"data: [DONE]\n\n"], cut_at=2)

    def _images(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = self._answered_by(body.get("model") or "gpt-image-1")
        if model is None:
            self._unknown_model(record, body.get("model"))
            return
        size = body.get("size") if body.get("size") not in (None, "auto") else "1024x1024"
        quality = body.get("quality") if body.get("quality") not in (None, "auto") else "medium"
        per_image = IMAGE_OUTPUT_TOKENS.get(str(size), {}).get(str(quality))
        if per_image is None:
            record.status = 400
            self._error(400, f"unsupported size {size} or quality {quality}", record.request_id)
            return
        n = body.get("n") or 1
        used = Usage(
            input_tokens=text_tokens(str(body.get("prompt") or "")),
            output_tokens=per_image * n,
            output_image_tokens=per_image * n,
        )
        self._bill(record, model, used)
        if self._after_billing(record):
            return
        self._send_json(200, answers.images(n, used, str(size), str(quality)), record.request_id)

    def _speech(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = self._answered_by(body.get("model"))
        text = body.get("input")
        if model is None or not isinstance(text, str):
            self._unknown_model(record, body.get("model"))
            return
        self._bill(record, model, Usage(input_characters=len(text)))
        if self._after_billing(record):
            return
        audio = b"ID3\x04\x00\x00\x00\x00\x00\x00" + hashlib.sha256(text.encode()).digest()
        self._send_bytes(200, audio, record.request_id, "audio/mpeg")

    # -- Anthropic messages ------------------------------------------------------------

    def _anthropic_tokens(self, model: str, body: dict[str, Any]) -> Usage:
        """A message's usage before the prompt cache is consulted."""
        input_tokens = prompt_tokens(
            body.get("messages", []),
            body.get("system"),
            _extras(body, ("tools", "tool_choice")),
            self.fake.realism,
        )
        return self._tokens(model, input_tokens, body.get("max_tokens"))

    @property
    def _cache(self) -> PromptCache | None:
        return self.fake.cache if self.fake.realism.cache else None

    def _anthropic_usage(
        self, model: str, body: dict[str, Any], used: Usage | None = None
    ) -> Usage:
        used = self._anthropic_tokens(model, body) if used is None else used
        cache = self._cache
        if cache is None:
            return used
        plain, read, written, written_1h = cache.split(body, used.input_tokens)
        return Usage(
            input_tokens=plain,
            cached_input_tokens=used.cached_input_tokens + read,
            cache_write_tokens=written,
            cache_write_1h_tokens=written_1h,
            output_tokens=used.output_tokens,
        )

    def _messages(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = self._answered_by(body.get("model"))
        if model is None:
            self._unknown_model(record, body.get("model"))
            return
        used = self._anthropic_tokens(model, body)
        if not self._admit(record, fake_limits.anthropic_ask(self._cache, body, used)):
            return
        usage = self._anthropic_usage(model, body, used)
        tier = tier_of(body.get("service_tier"), self.fake.realism, anthropic=True)
        self._bill(record, model, usage)
        if self._rate is not None:
            self.fake.limits.settle(self._rate, usage)
        message = answers.anthropic_message(
            self.fake._next_id("msg_"), model, usage, body.get("max_tokens"), tier
        )
        tool = _tool_to_call(body, anthropic=True)
        if tool is not None and not body.get("stream"):
            message["content"] = [
                {
                    "type": "tool_use",
                    "id": self.fake._next_id("toolu_"),
                    "name": tool,
                    "input": _tool_arguments(body, anthropic=True),
                }
            ]
            message["stop_reason"] = "tool_use"
        if self._after_billing(record):
            return
        if not body.get("stream"):
            self._send_json(200, message, record.request_id)
            return
        events = [
            f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            for name, data in answers.anthropic_events(message)
        ]
        self._sse(record, events, cut_at=3)

    def _count_tokens(self, record: Served, body: dict[str, Any], query: Any) -> None:
        tokens = prompt_tokens(
            body.get("messages", []),
            body.get("system"),
            _extras(body, ("tools",)),
            self.fake.realism,
        )
        self._send_json(200, {"input_tokens": tokens}, record.request_id)

    # -- Anthropic message batches -------------------------------------------------------

    def _batch_create(self, record: Served, body: dict[str, Any], query: Any) -> None:
        # a batch counts one request against the vendor's "*" limits (batches have
        # limits of their own, across models) and none of its items' tokens
        if not self._admit(record, fake_limits.Ask()):
            return
        results = []
        batched = self.fake.realism.batch_discount
        for item in body.get("requests", []):
            params = item.get("params", {})
            model = self._answered_by(params.get("model"))
            if model is None:
                results.append(
                    {
                        "custom_id": item.get("custom_id"),
                        "result": {
                            "type": "errored",
                            "error": {
                                "type": "error",
                                "error": {
                                    "type": "not_found_error",
                                    "message": f"model {params.get('model')!r}",
                                },
                            },
                        },
                    }
                )
                continue
            usage = self._anthropic_usage(model, params)
            self._bill(record, model, usage, PriceContext(batch=batched))
            tier = "batch" if batched else "standard"
            results.append(
                {
                    "custom_id": item.get("custom_id"),
                    "result": {
                        "type": "succeeded",
                        "message": answers.anthropic_message(
                            self.fake._next_id("msg_"), model, usage, params.get("max_tokens"), tier
                        ),
                    },
                }
            )
        record.answered_by = None
        work = float(self.headers.get("x-fake-work-seconds") or 0)
        job = _Job(
            "batch",
            self.fake._next_id("msgbatch_"),
            time.time(),
            time.time() + work,
            "",
            {"results": results},
        )
        with self.fake._lock:
            self.fake._jobs[job.id] = job
        answer = answers.batch_object(job.id, job.created_at, job.ready_at, results)
        self._send_json(200, answer, record.request_id)

    def _batch_job(self, record: Served, batch_id: str) -> _Job | None:
        with self.fake._lock:
            job = self.fake._jobs.get(batch_id)
        if job is None or job.kind != "batch":
            record.status = 404
            self._error(404, f"batch {batch_id} not found", record.request_id)
            return None
        return job

    def _batch_get(self, record: Served, batch_id: str) -> None:
        job = self._batch_job(record, batch_id)
        if job is not None:
            answer = answers.batch_object(
                job.id, job.created_at, job.ready_at, job.payload["results"]
            )
            self._send_json(200, answer, record.request_id)

    def _batch_results(self, record: Served, batch_id: str) -> None:
        job = self._batch_job(record, batch_id)
        if job is None:
            return
        lines = "".join(json.dumps(r) + "\n" for r in job.payload["results"]).encode()
        self._send_bytes(200, lines, record.request_id, "application/binary")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the fake LLM provider.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument(
        "--kind", action="store_true", help="turn off every realistic behaviour (see Realism)"
    )
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar=fake_limits.LIMIT_FORM,
        help=f"rate-limit a model (or * for all of the vendor's) a minute, e.g. "
        f"{fake_limits.LIMIT_EXAMPLE}; repeatable",
    )
    args = parser.parse_args(argv)
    try:  # every --limit is checked before the port is taken
        specs = fake_limits.parse_limits(args.limit, default_prices())
    except ValueError as exc:
        print(f"error: --limit {exc}", file=sys.stderr)
        sys.exit(2)
    fake = FakeProvider(args.host, args.port, realism=Realism.kind() if args.kind else None)
    for spec in specs:
        fake.set_limits(spec.vendor, spec.model, **spec.limits)
    print(f"fake provider on {fake.url} (OpenAI base {fake.openai_base_url})", flush=True)
    for spec in specs:
        print(f"rate limit {fake_limits.describe(spec)}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        fake.serve_forever()


if __name__ == "__main__":
    main()
