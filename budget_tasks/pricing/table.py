"""Your own price table: contract prices that override the maintained source.

A JSON file of this shape (micro-USD per million tokens, integers)::

    {"version": "acme-2026-11", "unit": "micro-USD per million tokens",
     "models": {"gpt-4o": {"input": 2000000, "cached_input": 1000000, "output": 8000000,
                           "variants": {"batch": {"input": 1000000, "output": 4000000}}}}}

Fields per model: ``input`` and ``output`` (required), ``cached_input``,
``cache_write`` (5-minute cache), ``cache_write_1h``, ``input_audio``, ``input_image``,
``output_audio``, ``output_image``, ``web_search`` (per search), ``input_character``
(per million characters), and ``variants`` keyed by a service tier or ``batch`` with
the fields that differ. A model matches by its name, or by a snapshot id of it
(``gpt-4o-2024-08-06`` matches ``gpt-4o``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .. import _validate as check
from ..errors import UnknownModelPrice
from .rates import PER_MILLION, Estimating, Rates
from .usage import STANDARD, PriceContext, Usage

#: A snapshot's date suffix: ``-2024-08-06`` (OpenAI) or ``-20251001`` (Anthropic).
_SNAPSHOT = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8})$")


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """Minor units per million tokens (see :class:`~budget_tasks.pricing.Rates`)."""

    input: int
    cached_input: int
    output: int
    cache_write: int | None = None
    provider: str | None = None
    cache_write_1h: int | None = None
    input_audio: int | None = None
    input_image: int | None = None
    output_audio: int | None = None
    output_image: int | None = None
    web_search: int | None = None
    input_character: int | None = None
    variants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @property
    def dearest_input(self) -> int:
        return self.rates().dearest_input()

    def rates(self, context: PriceContext = STANDARD) -> Rates:
        base = Rates(
            input=self.input,
            output=self.output,
            cached_input=self.cached_input,
            cache_write=self.cache_write,
            cache_write_1h=self.cache_write_1h,
            input_audio=self.input_audio,
            input_image=self.input_image,
            output_audio=self.output_audio,
            output_image=self.output_image,
            web_search=self.web_search,
            input_character=self.input_character,
        )
        for name in _variant_names(context):
            override = self.variants.get(name)
            if override:
                base = replace(base, **dict(override))
        return base


#: Variants billed above the base rates: without one, the table cannot price them.
_DEARER = frozenset({"priority", "scale", "fast"})


def _variant_names(context: PriceContext) -> list[str]:
    names = []
    if context.service_tier:
        names.append(context.service_tier)
    if context.speed:
        names.append(context.speed)
    if context.batch:
        names.append("batch")
    return names


@dataclass(frozen=True)
class PriceTable(Estimating):
    """A versioned table of prices per model (see the module)."""

    version: str
    models: Mapping[str, ModelPrice] = field(default_factory=dict)
    unit: str = "micro-USD per million tokens"

    def find(self, model: str) -> ModelPrice | None:
        """The model's prices by its name or, for a snapshot id, its alias's."""
        found = self.models.get(model)
        if found is None:
            alias = _SNAPSHOT.sub("", model)
            found = self.models.get(alias) if alias != model else None
        return found

    def knows(self, model: str, provider: str | None = None) -> bool:
        found = self.find(model)
        return found is not None and (
            provider is None or found.provider is None or found.provider == provider
        )

    def price(self, model: str) -> ModelPrice:
        """The model's prices; raises UnknownModelPrice (never a guessed price)."""
        found = self.find(model)
        if found is None:
            raise UnknownModelPrice(model, self.version)
        return found

    def rates(
        self,
        model: str,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
        input_tokens: int = 0,
    ) -> Rates:
        """The model's rates in ``context``. A dearer tier or mode (priority, fast) the
        table has no variant for raises UnknownModelPrice: its base rates would charge
        it too little. (Its rates apply at every context length: give a long-context
        model's long-context rates if your calls may reach them.)"""
        price = self.price(model)
        for dearer in _DEARER & set(_variant_names(context)):
            if dearer not in price.variants:
                raise UnknownModelPrice(f"{model} ({dearer})", self.version)
        return price.rates(context)

    def cost(
        self,
        model: str,
        usage: Usage,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
    ) -> int:
        """What ``usage`` costs on ``model``, rounded up to a whole minor unit."""
        r = self.rates(model, provider=provider, context=context)
        cache_write = r.cache_write if r.cache_write is not None else r.input
        plain_input = usage.input_tokens - usage.input_audio_tokens - usage.input_image_tokens
        plain_output = usage.output_tokens - usage.output_audio_tokens - usage.output_image_tokens
        total = (
            plain_input * r.input
            + usage.input_audio_tokens * _or(r.input_audio, r.input)
            + usage.input_image_tokens * _or(r.input_image, r.input)
            + usage.cached_input_tokens * _or(r.cached_input, r.input)
            + usage.cache_write_tokens * cache_write
            + usage.cache_write_1h_tokens * _or(r.cache_write_1h, cache_write)
            + plain_output * r.output
            + usage.output_audio_tokens * _or(r.output_audio, r.output)
            + usage.output_image_tokens * _or(r.output_image, r.output)
            + usage.input_characters * (r.input_character or 0)
        )
        per_search = usage.web_searches * (r.web_search or 0) * PER_MILLION
        return -(-(total + per_search) // PER_MILLION)


def _or(value: int | None, fallback: int) -> int:
    return fallback if value is None else value


_RATE_FIELDS = tuple(
    f.name for f in fields(ModelPrice) if f.name not in ("provider", "variants", "cached_input")
)


def load_prices(path: str | Path) -> PriceTable:
    """Load your own price table from a JSON file (see the module for its shape)."""
    return parse_prices(json.loads(Path(path).read_text("utf-8")))


def parse_prices(data: Mapping[str, Any]) -> PriceTable:
    if not isinstance(data, Mapping):
        raise TypeError(f"a price table is a JSON object, not {type(data).__name__}")
    version = check.text(data.get("version"), "price table version", max_length=40)
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
        unknown = set(entry) - {*_RATE_FIELDS, "cached_input", "provider", "variants"}
        if unknown:
            raise ValueError(f"the prices of {name!r} have unknown fields {sorted(unknown)}")
        rates = {
            key: check.money(entry[key], f"{name} {key} price")
            for key in _RATE_FIELDS
            if entry.get(key) is not None
        }
        variants: dict[str, dict[str, int]] = {}
        for variant, changes in (entry.get("variants") or {}).items():
            if not isinstance(changes, Mapping) or set(changes) - {*_RATE_FIELDS, "cached_input"}:
                raise ValueError(f"variant {variant!r} of {name!r} names unknown fields")
            variants[str(variant)] = {
                key: check.money(value, f"{name} {variant} {key} price")
                for key, value in changes.items()
            }
        models[name] = ModelPrice(
            cached_input=check.money(
                entry.get("cached_input", entry["input"]), f"{name} cached input price"
            ),
            provider=None
            if entry.get("provider") is None
            else check.text(entry["provider"], f"{name} provider", max_length=64),
            variants=variants,
            **rates,
        )
    return PriceTable(version=version, models=models, unit=str(data.get("unit", "")))
