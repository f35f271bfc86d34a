"""What an error from a provider call means for the money: definitely not billed, or
unknown. Read from the SDKs' own exception types and status codes."""

from __future__ import annotations

import enum

#: Statuses after which the provider did not bill: the request was refused up front.
NOT_BILLED_STATUSES = frozenset({400, 401, 403, 404, 422})
RATE_LIMITED_STATUS = 429
#: Refused for now, not billed, to be sent again later as a new attempt: rate limited
#: (429), and Anthropic's overloaded (529).
RETRY_LATER_STATUSES = frozenset({RATE_LIMITED_STATUS, 529})
# Transport errors raised before any byte of the request was written.
_PRE_SEND = frozenset({"ConnectError", "ConnectTimeout", "ConnectionRefusedError"})
#: h11 (under httpx) refuses a header it cannot write (a key read with its line break)
#: while it builds the request line and headers: before the first byte is written.
_REFUSED_HEADER = ("Illegal header value", "Illegal header name")
#: Where httpx encodes a header value as ASCII, as the request is built.
_HEADER_ENCODING = frozenset({"_normalize_header_value", "_normalize_header_key"})


class ErrorOutcome(enum.Enum):
    """How an error from a billable call settles its hold."""

    #: Refused before any work (4xx such as 400/401/403/404/422, or no connection):
    #: release the hold.
    NOT_BILLED = "not_billed"
    #: 429 (or Anthropic's 529, overloaded): not billed; a retry is a new attempt with a
    #: new hold, never a silent one.
    RATE_LIMITED = "rate_limited"
    #: Anything else (timeouts, resets after sending, 5xx, a cut stream): keep the hold
    #: until reconciliation says what happened.
    UNKNOWN = "unknown"

    @property
    def billed(self) -> bool | None:
        """False when certainly not billed, None when unknown."""
        return None if self is ErrorOutcome.UNKNOWN else False


def classify(exc: BaseException) -> ErrorOutcome:
    """Classify an exception raised by an OpenAI or Anthropic SDK call."""
    status = getattr(exc, "status_code", None)
    if getattr(exc, "response", None) is not None and isinstance(status, int):
        if status in RETRY_LATER_STATUSES:
            return ErrorOutcome.RATE_LIMITED
        if status in NOT_BILLED_STATUSES:
            return ErrorOutcome.NOT_BILLED
        return ErrorOutcome.UNKNOWN
    if never_sent(exc):
        return ErrorOutcome.NOT_BILLED
    return ErrorOutcome.UNKNOWN


def never_sent(exc: BaseException) -> bool:
    """True if the chain of causes shows not a byte of the request left: the connection
    was never made (refused, no such host, a connect timeout), or the HTTP library
    refused a header as it built the request (a line break or a byte outside ASCII in
    a key)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in _PRE_SEND or _refused_header(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _refused_header(exc: BaseException) -> bool:
    if type(exc).__name__ == "LocalProtocolError":
        return str(exc).startswith(_REFUSED_HEADER)
    if isinstance(exc, UnicodeEncodeError):
        frame = exc.__traceback__
        innermost = None
        while frame is not None:
            innermost, frame = frame, frame.tb_next
        return innermost is not None and innermost.tb_frame.f_code.co_name in _HEADER_ENCODING
    return False
