"""Prices and estimates in integer minor units (micro-USD by default).

A versioned price table (``prices.json`` in the package, or your own) gives each
model's price per million tokens for input, cached input, cache writes and output.
Costs round up: ``ceil(sum(tokens x price) / 1e6)``, computed in integers.

Estimates are upper bounds, so that a reservation is never below the real charge:
input tokens are bounded by the UTF-8 byte length of the prompt plus a per-message
overhead (no tokenizer emits more tokens than bytes), output tokens by the request's
max output limit, every input token priced at the dearest input rate.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from . import _validate as check
from .errors import EstimateRefused, UnknownModelPrice

PER_MILLION = 1_000_000
#: Tokens a chat format may add per message (role, separators) and per request.
MESSAGE_OVERHEAD_TOKENS = 8
REQUEST_OVERHEAD_TOKENS = 8


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """Minor units per million tokens."""

    input: int
    cached_input: int
    output: int
    cache_write: int | None = None
    provider: str | None = None

    @property
    def dearest_input(self) -> int:
        return max(self.input, self.cached_input, self.cache_write or 0)


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a provider reports for one call, in one shape for every provider.

    ``input_tokens`` excludes cached reads and cache writes; ``output_tokens`` includes
    reasoning tokens (``reasoning_tokens`` says how many of them there were).
    """

    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        for name in (
            "input_tokens",
            "cached_input_tokens",
            "cache_write_tokens",
            "output_tokens",
            "reasoning_tokens",
        ):
            check.count(getattr(self, name), name)
        if self.reasoning_tokens > self.output_tokens:
            raise ValueError("reasoning tokens are part of output tokens, not more than them")

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.cached_input_tokens + other.cached_input_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
            self.output_tokens + other.output_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
        )


@dataclass(frozen=True, slots=True)
class Estimate:
    """An upper bound on a call's cost, and what it was computed from."""

    amount: int
    model: str
    input_tokens: int
    output_tokens: int
    price_version: str


@dataclass(frozen=True, slots=True)
class PriceTable:
    version: str
    models: Mapping[str, ModelPrice] = field(default_factory=dict)
    unit: str = "micro-USD per million tokens"

    def price(self, model: str) -> ModelPrice:
        """The model's prices; raises UnknownModelPrice (never a guessed price)."""
        try:
            return self.models[model]
        except KeyError:
            raise UnknownModelPrice(model, self.version) from None

    def cost(self, model: str, usage: Usage) -> int:
        """What ``usage`` costs on ``model``, rounded up to a whole minor unit."""
        p = self.price(model)
        cache_write = p.cache_write if p.cache_write is not None else p.input
        total = (
            usage.input_tokens * p.input
            + usage.cached_input_tokens * p.cached_input
            + usage.cache_write_tokens * cache_write
            + usage.output_tokens * p.output
        )
        return -(-total // PER_MILLION)

    def estimate(
        self,
        model: str,
        prompt: Iterable[str],
        max_output_tokens: int | None,
        *,
        choices: int = 1,
        extra_input_tokens: int = 0,
        extra_output_tokens: int = 0,
    ) -> Estimate:
        """An upper bound for a request whose billed input texts are ``prompt``.

        Output is ``max_output_tokens`` per choice, times ``choices`` (OpenAI's ``n``),
        plus ``extra_output_tokens``; ``extra_input_tokens`` are input the texts do not
        show (per-image bounds, the format around tools). Refused (EstimateRefused)
        without a max output limit: an unbounded output has no upper bound. Unknown
        models raise UnknownModelPrice.
        """
        p = self.price(model)
        if max_output_tokens is None:
            raise EstimateRefused(
                f"a request to {model} without a max output token limit has no upper bound; "
                "set max_tokens / max_output_tokens or give an explicit estimate"
            )
        check.count(max_output_tokens, "max_output_tokens")
        check.positive(choices, "choices")
        check.count(extra_input_tokens, "extra_input_tokens")
        check.count(extra_output_tokens, "extra_output_tokens")
        if max_output_tokens == 0:
            raise EstimateRefused("max_output_tokens must be positive")
        texts = list(prompt)
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"prompt texts must be str, not {type(text).__name__} ({text!r})")
        input_tokens = (
            REQUEST_OVERHEAD_TOKENS
            + extra_input_tokens
            + sum(len(text.encode("utf-8")) + MESSAGE_OVERHEAD_TOKENS for text in texts)
        )
        output_tokens = max_output_tokens * choices + extra_output_tokens
        total = input_tokens * p.dearest_input + output_tokens * p.output
        return Estimate(
            amount=-(-total // PER_MILLION),
            model=model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            price_version=self.version,
        )


def load_prices(path: str | Path | None = None) -> PriceTable:
    """Load a price table: the packaged one by default, or a JSON file of that shape."""
    if path is None:
        raw = resources.files("budget_tasks").joinpath("prices.json").read_text("utf-8")
    else:
        raw = Path(path).read_text("utf-8")
    return parse_prices(json.loads(raw))


def parse_prices(data: Mapping[str, Any]) -> PriceTable:
    if not isinstance(data, Mapping):
        raise TypeError(f"a price table is a JSON object, not {type(data).__name__}")
    version = check.text(data.get("version"), "price table version")
    raw = data.get("models", {})
    if not isinstance(raw, Mapping):
        raise TypeError(f"the price table's models are an object, not {type(raw).__name__}")
    models = {}
    for name, entry in raw.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"the prices of {name!r} are an object, not {type(entry).__name__}")
        for required in ("input", "output"):
            if required not in entry:
                raise ValueError(f"the prices of {name!r} have no {required!r} price")
        models[name] = ModelPrice(
            input=check.money(entry["input"], f"{name} input price"),
            cached_input=check.money(
                entry.get("cached_input", entry["input"]), f"{name} cached input price"
            ),
            output=check.money(entry["output"], f"{name} output price"),
            cache_write=None
            if entry.get("cache_write") is None
            else check.money(entry["cache_write"], f"{name} cache write price"),
            provider=entry.get("provider"),
        )
    return PriceTable(version=version, models=models, unit=str(data.get("unit", "")))


_default: PriceTable | None = None


def default_prices() -> PriceTable:
    """The packaged price table, loaded once."""
    global _default
    if _default is None:
        _default = load_prices()
    return _default
