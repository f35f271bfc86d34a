"""Secrets out of error text: what is stored in the ledger or written to a log never
carries an API key. An HTTP library's error may quote a header it refused (``Illegal
header value b'Bearer sk-...\\n'``), and an SDK's may echo a request's headers."""

from __future__ import annotations

import logging
import re

REDACTED = "[redacted]"

_CREDENTIAL_CHARS = r"[A-Za-z0-9._~+/=\-]{8,}"
_PATTERNS = (
    # h11's refusal of a header quotes its whole value (any key, not only sk-...)
    re.compile(r"(?i)(illegal header value )(b?['\"])[^'\"]+"),
    # a key-bearing header or field named with its value: x-api-key: ..., api_key=...
    re.compile(
        r"(?i)\b(x-api-key|api[_-]?key|auth[_-]?token|x-goog-api-key)"
        r"(['\"]?\s*[:=]\s*(?:b(?=['\"]))?['\"]?)[^\s'\",;)\[\]{}]+"
    ),
    # an Authorization header's credentials (Bearer, Basic), wherever it is quoted
    re.compile(r"(?i)\b(bearer|basic)(\s+)" + _CREDENTIAL_CHARS),
    # OpenAI and Anthropic keys (sk-..., sk-proj-..., sk-ant-...), and look-alikes
    re.compile(r"\b(sk-)[A-Za-z0-9_\-]{4,}"),
)


def redact(text: str) -> str:
    """``text`` with every credential it shows replaced by ``[redacted]``."""
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: f"{m.group(1)}{_gap(m)}{REDACTED}", text)
    return text


def _gap(match: re.Match[str]) -> str:
    return match.group(2) if match.re.groups >= 2 else ""


class RedactingFilter(logging.Filter):
    """A handler filter that redacts a record's message and its traceback before any
    formatter writes them (installed on the worker's and beat's log handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def redact_handlers(logger: logging.Logger) -> None:
    """Put a :class:`RedactingFilter` on every handler of ``logger`` (once each)."""
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
