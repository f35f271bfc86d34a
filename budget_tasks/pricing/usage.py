"""What a call used, how it was billed, and what an estimate bounds: plain records in
integer counts, one shape for every vendor."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime

from .. import _validate as check


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens (and other units) a provider reports for one call.

    ``input_tokens`` are the input tokens billed at the plain input rate: cache reads
    (``cached_input_tokens``) and cache writes (``cache_write_tokens`` for the 5-minute
    cache, ``cache_write_1h_tokens`` for the 1-hour one) are apart from it. Audio and
    image input tokens are part of ``input_tokens``; reasoning, audio and image output
    tokens are part of ``output_tokens``. ``web_searches`` and ``input_characters`` (a
    speech request's text) are billed per unit.
    """

    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cache_write_1h_tokens: int = 0
    input_audio_tokens: int = 0
    input_image_tokens: int = 0
    output_audio_tokens: int = 0
    output_image_tokens: int = 0
    web_searches: int = 0
    input_characters: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            check.count(getattr(self, f.name), f.name)
        if self.reasoning_tokens + self.output_audio_tokens + self.output_image_tokens > (
            self.output_tokens
        ):
            raise ValueError(
                "reasoning, audio and image output tokens are part of output tokens, "
                "not more than them"
            )
        if self.input_audio_tokens + self.input_image_tokens > self.input_tokens:
            raise ValueError("audio and image input tokens are part of input tokens")

    @property
    def input_total(self) -> int:
        """Every input token however billed (plain, cache reads, cache writes): what the
        vendors' usage reports count as input."""
        return (
            self.input_tokens
            + self.cached_input_tokens
            + self.cache_write_tokens
            + self.cache_write_1h_tokens
        )

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    @property
    def total_input_tokens(self) -> int:
        """Every input token, however billed (plain, cache reads and writes)."""
        return (
            self.input_tokens
            + self.cached_input_tokens
            + self.cache_write_tokens
            + self.cache_write_1h_tokens
        )


@dataclass(frozen=True, slots=True)
class PriceContext:
    """How a call was (or may be) billed, beyond its tokens: the service tier the
    provider says billed it (``priority``, ``flex``, ``default``...), whether it ran in a
    batch (half price at both vendors), and when (prices change over time)."""

    service_tier: str | None = None
    batch: bool = False
    at: datetime | None = None
    #: Anthropic's fast mode (``usage.speed``)
    speed: str | None = None

    def as_genai(self) -> dict[str, str]:
        """The context in genai-prices' terms."""
        out: dict[str, str] = {}
        if self.service_tier and self.service_tier not in ("auto", "standard"):
            out["service_tier"] = self.service_tier
        if self.batch:
            out["processing"] = "batch"
        if self.speed:
            out["speed"] = self.speed
        return out


STANDARD = PriceContext()


@dataclass(frozen=True, slots=True)
class Estimate:
    """An upper bound on a call's cost, and what it was computed from."""

    amount: int
    model: str
    input_tokens: int
    output_tokens: int
    price_version: str
