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
