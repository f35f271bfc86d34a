"""What one call counts against a provider's rate limits: shared by the ledger, which
takes it from its windows, and the providers, whose rules say what a call asks and
what their vendor counted it as in the end."""

from __future__ import annotations

from dataclasses import dataclass

from . import _validate as check

#: The kinds of a provider's rate limit, each counted a minute.
RATE_KINDS = ("requests", "tokens", "input_tokens", "output_tokens")


@dataclass(frozen=True, slots=True)
class RateAsk:
    """What one call counts against its scope's rate limits (or, settled, what its
    vendor counted it as in the end)."""

    requests: int = 1
    tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def __post_init__(self) -> None:
        for kind in RATE_KINDS:
            check.count(getattr(self, kind), kind)

    def of(self, kind: str) -> int:
        value: int = getattr(self, kind)
        return value


@dataclass(frozen=True, slots=True)
class RateSeen:
    """What a provider's answer said remains of its rate limits (None: not said), when
    it said it (``at_ms``, milliseconds since the epoch), and for a refusal how long
    it said to wait (``wait_ms``): the windows the call took from are narrowed to it,
    never widened, so a limit set too high, or a quota other software shares, still
    ends the provider's refusals."""

    at_ms: int
    requests: int | None = None
    tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    wait_ms: int = 0
    #: the limits a minute the answer states for the call (None: not stated)
    requests_limit: int | None = None
    tokens_limit: int | None = None
    input_tokens_limit: int | None = None
    output_tokens_limit: int | None = None

    def __post_init__(self) -> None:
        check.count(self.at_ms, "at_ms")
        check.count(self.wait_ms, "wait_ms")
        for kind in RATE_KINDS:
            for name in (kind, f"{kind}_limit"):
                value = getattr(self, name)
                if value is not None:
                    check.count(value, name)

    def of(self, kind: str) -> int | None:
        """What the answer said remains of ``kind``."""
        value: int | None = getattr(self, kind)
        return value

    def limit_of(self, kind: str) -> int | None:
        """The limit a minute of ``kind`` the answer stated."""
        value: int | None = getattr(self, f"{kind}_limit")
        return value
