"""A gateway that answers like a broken or malicious one, for the OpenAI and Anthropic
SDKs to call over HTTP: each request names how to misbehave in ``x-hostile``:

- ``usage=IN,OUT``: a well-formed answer that reports IN input and OUT output tokens
  (10**18 for an absurd claim; the request's own bound, or one past it);
- ``negative``: a well-formed answer whose usage is negative;
- ``non-json``: status 200, ``application/json``, and an HTML page as the body;
- ``huge=BYTES``: a well-formed answer whose text is BYTES long, honest usage;
- ``truncated-gzip``: a gzip-compressed answer cut off half way;
- ``reset``: the request read, the connection closed without an answer (it may have
  billed: the outcome is unknown);
- ``echo``: a well-formed answer whose text is ``ECHO:`` and the request's last user
  message (content a test can search for wherever it was stored);
- nothing: a plain, honest answer.

``POST /v1/responses`` with ``background`` answers queued, and ``GET /v1/responses/{id}``
then answers it completed with the usage its POST named: what reconciliation finds.
Every request is kept (``requests``) with its headers, for tests to check what was sent.
"""

from __future__ import annotations

import gzip
import json
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


@dataclass
class HostileGateway:
    requests: list[Seen] = field(default_factory=list)
    #: a background Response's id -> the usage (in, out) its lookup answers with
    queued: dict[str, tuple[int, int]] = field(default_factory=dict)

    def start(self) -> HostileGateway:
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                body = json.loads(raw) if raw else None
                gateway.requests.append(Seen("POST", self.path, dict(self.headers.items()), body))
                gateway._answer(self, body or {})

            def do_GET(self) -> None:
                gateway.requests.append(Seen("GET", self.path, dict(self.headers.items()), None))
                response_id = self.path.rsplit("/", 1)[-1].split("?")[0]
                if not self.path.startswith("/v1/responses/") or response_id not in gateway.queued:
                    _send(self, 404, {"error": {"message": "not found", "type": "not_found"}})
                    return
                tokens_in, tokens_out = gateway.queued[response_id]
                _send(self, 200, _response(response_id, tokens_in, tokens_out, done=True))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    def posts(self) -> list[Seen]:
        return [r for r in self.requests if r.method == "POST"]

    def _answer(self, handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        mode = handler.headers.get("x-hostile", "")
        path = handler.path
        tokens_in, tokens_out, text = 10, 5, "fine"
        if mode.startswith("usage="):
            tokens_in, tokens_out = (int(n) for n in mode[len("usage=") :].split(","))
        elif mode == "negative":
            tokens_in, tokens_out = -10, -5
        elif mode.startswith("huge="):
            text = "x" * int(mode[len("huge=") :])
        elif mode == "echo":
            text = "ECHO:" + _last_user_text(body)
        if mode == "reset":
            handler.close_connection = True
            return
        if mode == "non-json":
            page = b"<html><body>502 Bad Gateway</body></html>"
            _raw(handler, 200, page, {"content-type": "application/json"})
            return
        if path.startswith("/v1/chat/completions"):
            answer = _chat(body, tokens_in, tokens_out, text)
        elif path.startswith("/v1/messages"):
            answer = _message(body, tokens_in, tokens_out, text)
        elif path.startswith("/v1/responses"):
            response_id = f"resp_{uuid.uuid4().hex}"
            if body.get("background"):
                self.queued[response_id] = (tokens_in, tokens_out)
                answer = _response(response_id, tokens_in, tokens_out, done=False)
            else:
                answer = _response(response_id, tokens_in, tokens_out, done=True)
        else:
            _send(handler, 404, {"error": {"message": "unknown endpoint", "type": "not_found"}})
            return
        if mode == "truncated-gzip":
            packed = gzip.compress(json.dumps(answer).encode())
            cut = packed[: len(packed) // 2]
            _raw(
                handler,
                200,
                cut,
                {"content-type": "application/json", "content-encoding": "gzip"},
            )
            return
        _send(handler, 200, answer)


def _last_user_text(body: dict[str, Any]) -> str:
    messages = body.get("messages") or [{"role": "user", "content": body.get("input", "")}]
    content = [m for m in messages if m.get("role") == "user"][-1]["content"]
    return content if isinstance(content, str) else json.dumps(content)


def _send(handler: BaseHTTPRequestHandler, status: int, answer: dict[str, Any]) -> None:
    _raw(handler, status, json.dumps(answer).encode(), {"content-type": "application/json"})


def _raw(
    handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str]
) -> None:
    handler.send_response(status)
    for name, value in {**headers, "x-request-id": f"req_{uuid.uuid4().hex[:12]}"}.items():
        handler.send_header(name, value)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _chat(body: dict[str, Any], tokens_in: int, tokens_out: int, text: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": body.get("model", "gpt-4o-mini"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": tokens_in,
            "completion_tokens": tokens_out,
            "total_tokens": tokens_in + tokens_out,
        },
    }


def _message(body: dict[str, Any], tokens_in: int, tokens_out: int, text: str) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "claude-haiku-4-5"),
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out},
    }


def _response(response_id: str, tokens_in: int, tokens_out: int, *, done: bool) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed" if done else "queued",
        "model": "gpt-4o-mini",
        "output": []
        if not done
        else [
            {
                "type": "message",
                "id": f"msg_{response_id}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "fine", "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "background": not done,
        "usage": None
        if not done
        else {
            "input_tokens": tokens_in,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tokens_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens_in + tokens_out,
        },
    }
