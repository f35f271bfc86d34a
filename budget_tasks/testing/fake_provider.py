"""A fake LLM provider that speaks enough of the OpenAI and Anthropic HTTP APIs for the
official SDKs to work unchanged, and bills every request it serves.

Run it in a thread (``FakeProvider().start()``) or as a process::

    python -m budget_tasks.testing.fake_provider --port 8089

OpenAI clients use ``base_url=<url>/v1``; Anthropic clients use ``base_url=<url>``.

Endpoints: ``POST /v1/chat/completions`` (plain and streamed, ``store`` + ``metadata``),
``GET /v1/chat/completions/{id}`` and ``GET /v1/chat/completions?metadata[k]=v``,
``POST /v1/responses`` (``background``) and ``GET /v1/responses/{id}``,
``POST /v1/messages`` (plain and streamed), ``POST /v1/messages/batches``,
``GET /v1/messages/batches/{id}`` and ``.../results``.

Tools: a (non-streamed) chat completion or message whose request carries tools and
ends with the user's own message asks for the first tool (``tool_calls`` /
``tool_use``); after a tool result the answer is text: a tool round trip.

Answers are compressed as the real APIs compress them: in the first of br, gzip, zstd
and deflate that the client's ``Accept-Encoding`` names (``encodings`` narrows it; ``()``
answers uncompressed); streams are flushed event by event.

Billing is deterministic: a message's text costs ``ceil(utf8 bytes / 4) + 4`` input
tokens, a request 3 more; output tokens are ``x-fake-output-tokens`` if given, else
``min(max tokens, 12 + input tokens % 17)``. Each served request is billed at the
package price table (unknown models get 404 and no bill).

Faults, per request in the ``x-fake-fault`` header or queued with ``plan()`` /
``POST /_fake/faults``: ``status=NNN`` (an error, not billed), ``delay=S`` (answer
after S seconds), ``hang=S`` (bill, then answer only after S seconds: the client times
out), ``reset`` (bill, then close the connection without an answer), ``cut-stream``
(bill, send part of the stream, then cut the connection).

State for tests: ``GET /_fake/state`` (or ``.state()``), ``POST /_fake/reset``.
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
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..pricing import PriceTable, Usage, default_prices
from . import fake_wire

CONTROL = "/_fake"
METADATA_PREFIX = "metadata["


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


@dataclass
class _Job:
    """A background response or a batch, finished once ``ready_at`` has passed."""

    kind: str
    id: str
    created_at: float
    ready_at: float
    model: str
    payload: dict[str, Any] = field(default_factory=dict)


#: What the fake bills for one image input, and for the tool-use prompt a provider adds
#: when a request carries tools (Anthropic documents a few hundred tokens).
IMAGE_TOKENS = 765
TOOL_PROMPT_TOKENS = 346
_IMAGE_PARTS = ("image_url", "input_image", "image")


def message_tokens(text: str) -> int:
    return -(-len(text.encode("utf-8")) // 4) + 4


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            (part.get("text", "") if part.get("type", "text") in ("text", "input_text")
             else "" if part.get("type") in _IMAGE_PARTS else json.dumps(part))
            if isinstance(part, dict) else str(part)
            for part in content
        )  # fmt: skip
    return str(content)


def _images_in(content: Any) -> int:
    if not isinstance(content, list):
        return 0
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") in _IMAGE_PARTS)


def prompt_tokens(messages: list[Any], system: Any = None, extras: Any = None) -> int:
    """The input tokens the fake bills: every message's text (tool calls and results
    as their JSON), the system prompt, images at a fixed count each, and ``extras``
    (tool definitions, a response schema) as JSON plus the tool-use prompt."""
    texts = [_text_of(system)] if system else []
    images = 0
    for m in messages:
        if not isinstance(m, dict):
            texts.append(str(m))
            continue
        text = _text_of(m.get("content"))
        images += _images_in(m.get("content"))
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"])
        texts.append(text)
    tokens = 3 + sum(message_tokens(t) for t in texts) + images * IMAGE_TOKENS
    if extras:
        tokens += message_tokens(json.dumps(extras)) + TOOL_PROMPT_TOKENS
    return tokens


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


def _extras(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: body[name] for name in names if body.get(name) is not None}


class FakeProvider:
    """The fake provider server. Use as a context manager or ``start()``/``stop()``."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, prices: PriceTable | None = None
    ) -> None:
        self.prices = prices or default_prices()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._served: list[Served] = []
        self._faults: list[dict[str, Any]] = []
        self._completions: dict[str, dict[str, Any]] = {}
        self._jobs: dict[str, _Job] = {}
        #: Content encodings the answers go out in when the client accepts them: "auto"
        #: (every one this fake can make, as the real APIs compress), or an order of
        #: names; () answers uncompressed.
        self.encodings: tuple[str, ...] | str = "auto"
        #: Stored chat completions: "on" (as requested by ``store``), "off" (nothing is
        #: stored, as with zero data retention) or "no-route" (the lookup routes 404).
        self.completion_storage = "on"
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

    def reset(self) -> None:
        with self._lock:
            self.completion_storage = "on"
            self.encodings = "auto"
            self._served.clear()
            self._faults.clear()
            self._completions.clear()
            self._jobs.clear()

    def served(self) -> list[Served]:
        with self._lock:
            return list(self._served)

    def state(self) -> dict[str, Any]:
        """Requests served, counts per Idempotency-Key and per body, total billed."""
        with self._lock:
            served = [asdict(s) for s in self._served]
        return {
            "requests": served,
            "by_key": dict(Counter(s["idempotency_key"] for s in served if s["idempotency_key"])),
            "by_body": dict(Counter(s["body_sha"] for s in served if s["method"] == "POST")),
            "billed_total": sum(s["billed"] for s in served),
        }

    def billed_for(self, key: str) -> int:
        """What the requests carrying this Idempotency-Key were billed."""
        return sum(s.billed for s in self.served() if s.idempotency_key == key)

    # -- internals used by the handler -------------------------------------------------

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

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- plumbing --------------------------------------------------------------------

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _encoding(self) -> str:
        return fake_wire.choose(self.headers.get("Accept-Encoding"), self.fake.encodings)

    def _send_json(self, status: int, obj: Any, request_id: str) -> None:
        self._send_bytes(status, json.dumps(obj).encode(), request_id, "application/json")

    def _send_bytes(self, status: int, raw: bytes, request_id: str, content_type: str) -> None:
        name = self._encoding()
        body = fake_wire.encode_whole(name, raw)
        if self._record is not None:
            self._record.encoding = name
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if name != "identity":
            self.send_header("Content-Encoding", name)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-request-id", request_id)
        self.send_header("request-id", request_id)
        self.end_headers()
        self.wfile.write(body)

    def _start_stream(self, request_id: str) -> None:
        self._stream = fake_wire.encoder(self._encoding())
        if self._record is not None:
            self._record.encoding = self._stream.name
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if self._stream.name != "identity":
            self.send_header("Content-Encoding", self._stream.name)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-request-id", request_id)
        self.send_header("request-id", request_id)
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

    def _error(self, status: int, message: str, request_id: str, anthropic: bool) -> None:
        if anthropic:
            kinds = {
                400: "invalid_request_error",
                401: "authentication_error",
                403: "permission_error",
                404: "not_found_error",
                429: "rate_limit_error",
                500: "api_error",
                529: "overloaded_error",
            }
            body: dict[str, Any] = {
                "type": "error",
                "error": {"type": kinds.get(status, "api_error"), "message": message},
            }
        else:
            body = {"error": {"message": message, "type": "fake_error", "code": str(status)}}
        self._send_json(status, body, request_id)

    # -- routing ---------------------------------------------------------------------

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        self._record = None
        raw = self._read_body() if method == "POST" else b""
        parts = urlsplit(self.path)
        path = parts.path.rstrip("/")
        if path.startswith(CONTROL):
            self._control(method, path, raw)
            return
        fake = self.fake
        request_id = fake._next_id("req_")
        body: dict[str, Any] = json.loads(raw) if raw else {}
        query = parse_qs(parts.query)
        fault = (
            fake._take_fault(path, self.headers.get("x-fake-fault")) if method == "POST" else None
        )
        anthropic = path.startswith("/v1/messages")
        record = Served(
            seq=0,
            method=method,
            path=path,
            model=body.get("model"),
            idempotency_key=self.headers.get("Idempotency-Key"),
            body_sha=hashlib.sha256(raw).hexdigest()[:16],
            request_id=request_id,
            status=200,
            fault=fault,
            billed=0,
            usage=None,
            at=time.time(),
        )
        # Recorded on arrival: a request still running (a hang) shows up at once, and one
        # that outlives a reset() does not leak into the next test's record.
        with fake._lock:
            record.seq = len(fake._served) + 1
            fake._served.append(record)
        self._record = record
        try:
            if fault:
                name, value = _parse_fault(fault)
                if name == "status":
                    record.status = int(value)
                    self._error(int(value), f"fake {int(value)}", request_id, anthropic)
                    return
                if name == "delay":
                    time.sleep(value)
            handler = self._endpoint(method, path)
            if handler is None:
                record.status = 404
                self._error(404, f"no route {method} {path}", request_id, anthropic)
                return
            handler(record, body, query)
        except OSError:
            record.status = record.status if record.status != 200 else 0  # the client left

    def _endpoint(self, method: str, path: str) -> Any:
        segments = path.split("/")[1:]
        routes: dict[tuple[str, ...], Any] = {
            ("POST", "v1", "chat", "completions"): self._chat,
            ("GET", "v1", "chat", "completions"): self._chat_list,
            ("POST", "v1", "responses"): self._responses_create,
            ("POST", "v1", "messages"): self._messages,
            ("POST", "v1", "messages", "batches"): self._batch_create,
        }
        stored = self.fake.completion_storage != "no-route"
        if method == "GET" and segments[:3] == ["v1", "chat", "completions"] and not stored:
            return None
        found = routes.get((method, *segments))
        if found:
            return found
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
        else:
            self._send_json(404, {"error": "unknown control path"}, "control")

    # -- billing ---------------------------------------------------------------------

    def _usage(self, model: str, input_tokens: int, max_tokens: int | None) -> Usage | None:
        if model not in self.fake.prices.models:
            return None
        limit = max_tokens if max_tokens is not None else 4096
        wanted = self.headers.get("x-fake-output-tokens")
        output = min(limit, int(wanted)) if wanted else min(limit, 12 + input_tokens % 17)
        cached = min(input_tokens, int(self.headers.get("x-fake-cached-tokens") or 0))
        reasoning = min(output, int(self.headers.get("x-fake-reasoning-tokens") or 0))
        return Usage(
            input_tokens=input_tokens - cached,
            cached_input_tokens=cached,
            output_tokens=output,
            reasoning_tokens=reasoning,
        )

    def _bill(self, record: Served, model: str, usage: Usage) -> None:
        record.billed = self.fake.prices.cost(model, usage)
        record.usage = asdict(usage)

    def _unknown_model(self, record: Served, model: str, anthropic: bool) -> None:
        record.status = 404
        self._error(404, f"The model {model!r} does not exist", record.request_id, anthropic)

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

    # -- OpenAI chat completions -------------------------------------------------------

    def _chat(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = body.get("model", "")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        extras = _extras(body, ("tools", "functions", "tool_choice", "response_format"))
        each = self._usage(model, prompt_tokens(body.get("messages", []), None, extras), max_tokens)
        if each is None:
            self._unknown_model(record, model, anthropic=False)
            return
        n = body.get("n") or 1
        # Output is billed per choice: n choices of the same length here.
        usage = Usage(
            input_tokens=each.input_tokens,
            cached_input_tokens=each.cached_input_tokens,
            output_tokens=each.output_tokens * n,
            reasoning_tokens=each.reasoning_tokens * n,
        )
        self._bill(record, model, usage)
        completion_id = self.fake._next_id("chatcmpl-")
        text = " ".join(["fake"] * max(1, each.output_tokens))
        completion = {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "finish_reason": "stop"
                    if each.output_tokens < (max_tokens or 10**9)
                    else "length",
                    "logprobs": None,
                }
                for index in range(n)
            ],
            "usage": _openai_chat_usage(usage),
            "metadata": body.get("metadata") or {},
        }
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
                            "function": {"name": tool, "arguments": "{}"},
                        }
                    ],
                }
                choice["finish_reason"] = "tool_calls"
        if body.get("store") and self.fake.completion_storage == "on":
            with self.fake._lock:
                self.fake._completions[completion_id] = completion
        if self._after_billing(record):
            return
        if not body.get("stream"):
            self._send_json(200, completion, record.request_id)
            return
        self._start_stream(record.request_id)
        base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": completion["created"],
            "model": model,
        }
        events = [
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            },
            *(
                {
                    **base,
                    "choices": [
                        {"index": 0, "delta": {"content": word + " "}, "finish_reason": None}
                    ],
                }
                for word in text.split(" ")
            ),
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {},
                        "finish_reason": completion["choices"][0]["finish_reason"],
                    }
                ],
            },
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**base, "choices": [], "usage": completion["usage"]})
        try:
            for i, event in enumerate(events):
                if record.fault == "cut-stream" and i == 2:
                    self._cut()
                    return
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self._end_stream()
        except OSError:
            return

    def _chat_get(self, record: Served, completion_id: str) -> None:
        with self.fake._lock:
            completion = self.fake._completions.get(completion_id)
        if completion is None:
            record.status = 404
            self._error(
                404,
                f"No chat completion found with id {completion_id}",
                record.request_id,
                anthropic=False,
            )
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
        model = body.get("model", "")
        raw_input = body.get("input", "")
        messages = [{"content": raw_input}] if isinstance(raw_input, str) else raw_input
        extras = _extras(body, ("tools", "tool_choice", "text"))
        usage = self._usage(
            model,
            prompt_tokens(messages, body.get("instructions"), extras),
            body.get("max_output_tokens"),
        )
        if usage is None:
            self._unknown_model(record, model, anthropic=False)
            return
        self._bill(record, model, usage)
        work = float(self.headers.get("x-fake-work-seconds") or 0)
        job = _Job(
            "response",
            self.fake._next_id("resp_"),
            time.time(),
            time.time() + work,
            model,
            {"usage": usage, "background": bool(body.get("background"))},
        )
        with self.fake._lock:
            self.fake._jobs[job.id] = job
        if self._after_billing(record):
            return
        self._send_json(
            200, _response_object(job, done=not job.payload["background"]), record.request_id
        )

    def _responses_get(self, record: Served, response_id: str) -> None:
        with self.fake._lock:
            job = self.fake._jobs.get(response_id)
        if job is None or job.kind != "response":
            record.status = 404
            self._error(
                404,
                f"Response with id '{response_id}' not found.",
                record.request_id,
                anthropic=False,
            )
            return
        self._send_json(
            200, _response_object(job, done=time.time() >= job.ready_at), record.request_id
        )

    # -- Anthropic messages ------------------------------------------------------------

    def _messages(self, record: Served, body: dict[str, Any], query: Any) -> None:
        model = body.get("model", "")
        usage = self._usage(
            model,
            prompt_tokens(
                body.get("messages", []),
                body.get("system"),
                _extras(body, ("tools", "tool_choice")),
            ),
            body.get("max_tokens"),
        )
        if usage is None:
            self._unknown_model(record, model, anthropic=True)
            return
        self._bill(record, model, usage)
        message = _anthropic_message(
            self.fake._next_id("msg_"), model, usage, body.get("max_tokens")
        )
        tool = _tool_to_call(body, anthropic=True)
        if tool is not None and not body.get("stream"):
            message["content"] = [
                {"type": "tool_use", "id": self.fake._next_id("toolu_"), "name": tool, "input": {}}
            ]
            message["stop_reason"] = "tool_use"
        if self._after_billing(record):
            return
        if not body.get("stream"):
            self._send_json(200, message, record.request_id)
            return
        self._start_stream(record.request_id)
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {**message["usage"], "output_tokens": 1},
        }
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": start}),
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            ("ping", {"type": "ping"}),
            *(
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": word + " "},
                    },
                )
                for word in message["content"][0]["text"].split(" ")
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                    "usage": {"output_tokens": usage.output_tokens},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        try:
            for i, (name, data) in enumerate(events):
                if record.fault == "cut-stream" and i == 3:
                    self._cut()
                    return
                self._chunk(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
            self._end_stream()
        except OSError:
            return

    # -- Anthropic message batches -------------------------------------------------------

    def _batch_create(self, record: Served, body: dict[str, Any], query: Any) -> None:
        results = []
        for item in body.get("requests", []):
            params = item.get("params", {})
            model = params.get("model", "")
            usage = self._usage(
                model,
                prompt_tokens(
                    params.get("messages", []),
                    params.get("system"),
                    _extras(params, ("tools", "tool_choice")),
                ),
                params.get("max_tokens"),
            )
            if usage is None:
                results.append(
                    {
                        "custom_id": item.get("custom_id"),
                        "result": {
                            "type": "errored",
                            "error": {
                                "type": "error",
                                "error": {"type": "not_found_error", "message": f"model {model!r}"},
                            },
                        },
                    }
                )
                continue
            record.billed += self.fake.prices.cost(model, usage)
            results.append(
                {
                    "custom_id": item.get("custom_id"),
                    "result": {
                        "type": "succeeded",
                        "message": _anthropic_message(
                            self.fake._next_id("msg_"), model, usage, params.get("max_tokens")
                        ),
                    },
                }
            )
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
        self._send_json(200, _batch_object(job), record.request_id)

    def _batch_job(self, record: Served, batch_id: str) -> _Job | None:
        with self.fake._lock:
            job = self.fake._jobs.get(batch_id)
        if job is None or job.kind != "batch":
            record.status = 404
            self._error(404, f"batch {batch_id} not found", record.request_id, anthropic=True)
            return None
        return job

    def _batch_get(self, record: Served, batch_id: str) -> None:
        job = self._batch_job(record, batch_id)
        if job is not None:
            self._send_json(200, _batch_object(job), record.request_id)

    def _batch_results(self, record: Served, batch_id: str) -> None:
        job = self._batch_job(record, batch_id)
        if job is None:
            return
        lines = "".join(json.dumps(r) + "\n" for r in job.payload["results"]).encode()
        self._send_bytes(200, lines, record.request_id, "application/binary")


def _openai_chat_usage(usage: Usage) -> dict[str, Any]:
    prompt = usage.input_tokens + usage.cached_input_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": usage.output_tokens,
        "total_tokens": prompt + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_input_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _response_object(job: _Job, *, done: bool) -> dict[str, Any]:
    usage: Usage = job.payload["usage"]
    text = " ".join(["fake"] * max(1, usage.output_tokens))
    return {
        "id": job.id,
        "object": "response",
        "created_at": int(job.created_at),
        "status": "completed" if done else "in_progress",
        "model": job.model,
        "output": []
        if not done
        else [
            {
                "type": "message",
                "id": f"msg_{job.id}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "background": job.payload["background"],
        "usage": None
        if not done
        else {
            "input_tokens": usage.input_tokens + usage.cached_input_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_input_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.input_tokens + usage.cached_input_tokens + usage.output_tokens,
        },
    }


def _anthropic_message(
    message_id: str, model: str, usage: Usage, max_tokens: int | None
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": " ".join(["fake"] * max(1, usage.output_tokens))}],
        "stop_reason": "max_tokens"
        if max_tokens and usage.output_tokens >= max_tokens
        else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cache_read_input_tokens": usage.cached_input_tokens,
            "cache_creation_input_tokens": 0,
        },
    }


def _batch_object(job: _Job) -> dict[str, Any]:
    ended = time.time() >= job.ready_at
    results = job.payload["results"]
    succeeded = sum(1 for r in results if r["result"]["type"] == "succeeded")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(job.created_at))
    return {
        "id": job.id,
        "type": "message_batch",
        "processing_status": "ended" if ended else "in_progress",
        "request_counts": {
            "processing": 0 if ended else len(results),
            "succeeded": succeeded if ended else 0,
            "errored": len(results) - succeeded if ended else 0,
            "canceled": 0,
            "expired": 0,
        },
        "created_at": stamp,
        "expires_at": stamp,
        "ended_at": stamp if ended else None,
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": f"/v1/messages/batches/{job.id}/results" if ended else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the fake LLM provider.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8089)
    args = parser.parse_args()
    fake = FakeProvider(args.host, args.port)
    print(f"fake provider on {fake.url} (OpenAI base {fake.openai_base_url})", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        fake._server.serve_forever()


if __name__ == "__main__":
    main()
