"""Prices from a maintained source: Pydantic's ``genai-prices``, from the data bundled
with the installed package (never fetched at run time; upgrade the package for newer
prices). It knows snapshot ids, cache reads and writes by TTL, service tiers, batch
prices, long-context tiers and price changes over time; its Decimal dollars become
integer minor units here, rounded up."""

from __future__ import annotations

import warnings
from bisect import bisect_left
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any

from ..errors import UnknownModelPrice
from .rates import PER_MILLION, Estimating, Rates
from .usage import STANDARD, PriceContext, Usage

#: Minor units per dollar (micro-USD).
MINOR_PER_DOLLAR = 1_000_000


def _ceil_minor(dollars: Decimal) -> int:
    return int((dollars * MINOR_PER_DOLLAR).to_integral_value(rounding=ROUND_CEILING))


class MaintainedPrices(Estimating):
    """Prices from ``genai-prices`` (see the module). ``provider`` names its provider
    ids (``openai``, ``anthropic``); a model is looked up in that provider only, never
    another's prices."""

    def __init__(self) -> None:
        import genai_prices
        from genai_prices import data_snapshot

        self._genai = genai_prices
        self._snapshot = data_snapshot.get_snapshot()
        self.version = f"genai-prices {genai_prices.__version__}"
        #: (model, provider) -> what the snapshot says: its lookup matches the model's
        #: name against every model of the provider, on every call otherwise
        self._models: dict[tuple[str, str | None], tuple[Any, Any]] = {}
        #: the prices in force (by their values) -> (those prices, their tier starts, rates
        #: by tier): every estimate and settlement of a model asks again for the same few
        self._rated: dict[tuple[int, ...], tuple[Any, list[int], dict[int, Rates]]] = {}

    def _model(self, model: str, provider: str | None) -> tuple[Any, Any]:
        found = self._models.get((model, provider))
        if found is None:
            found = self._find(model, provider)
            if len(self._models) >= 1024:  # names that match a pattern are unbounded
                self._models.clear()
            self._models[(model, provider)] = found
        return found

    def _find(self, model: str, provider: str | None) -> tuple[Any, Any]:
        try:
            if provider is None:
                found = self._snapshot.find_provider_model(model, None, None, None)
                return found[0], found[1]
            vendor = self._snapshot.find_provider(None, provider, None)
        except LookupError:
            raise UnknownModelPrice(model, self.version) from None
        info = vendor.find_model(model)  # no fallback to another provider's prices
        if info is None:
            raise UnknownModelPrice(model, self.version)
        return vendor, info

    def knows(self, model: str, provider: str | None = None) -> bool:
        try:
            self._model(model, provider)
        except UnknownModelPrice:
            return False
        return True

    def rates(
        self,
        model: str,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
        input_tokens: int = 0,
    ) -> Rates:
        """The model's rates for ``context``, in the long-context tier that
        ``input_tokens`` input tokens fall in."""
        _, info = self._model(model, provider)
        prices = info.get_prices(context.at or datetime.now(UTC), context.as_genai() or None)
        # a context's prices are a fresh copy each time, of the snapshot's own values: the
        # values say which prices these are (kept with them, so no id is reused)
        which = tuple([id(value) for value in vars(prices).values()])
        kept = self._rated.get(which)
        if kept is None:
            if len(self._rated) >= 1024:
                self._rated.clear()
            kept = self._rated[which] = (prices, _tier_starts(prices), {})
        # the tier is how many tier starts the input is past
        tier = bisect_left(kept[1], input_tokens)
        found = kept[2].get(tier)
        if found is None:
            found = kept[2][tier] = _rates_of(prices, input_tokens)
        return found

    def cost(
        self,
        model: str,
        usage: Usage,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
    ) -> int:
        """What ``usage`` costs, as genai-prices computes it, rounded up."""
        vendor, info = self._model(model, provider)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a key the model has no price for costs 0
            priced = info.calc_price(
                self._genai.Usage(**genai_usage(usage)),
                vendor,
                genai_request_timestamp=context.at or datetime.now(UTC),
                price_context=context.as_genai() or None,
            )
        return _ceil_minor(priced.total_price)


def genai_usage(usage: Usage) -> dict[str, int]:
    """``usage`` in genai-prices' keys: input totals that contain their parts."""
    keys = {
        "input_tokens": usage.total_input_tokens,
        "cache_read_tokens": usage.cached_input_tokens,
        "cache_write_tokens": usage.cache_write_tokens + usage.cache_write_1h_tokens,
        "cache_write_1h_tokens": usage.cache_write_1h_tokens,
        "output_tokens": usage.output_tokens,
        "input_audio_tokens": usage.input_audio_tokens,
        "input_image_tokens": usage.input_image_tokens,
        "output_audio_tokens": usage.output_audio_tokens,
        "output_image_tokens": usage.output_image_tokens,
        "web_searches": usage.web_searches,
        "input_characters": usage.input_characters,
    }
    return {k: v for k, v in keys.items() if v}


def _tier_starts(prices: Any) -> list[int]:
    """Where any of ``prices``' long-context tiers start, in order."""
    return sorted(
        {tier.start for value in vars(prices).values() for tier in getattr(value, "tiers", ())}
    )


def _rates_of(prices: Any, input_tokens: int) -> Rates:
    """``prices`` (genai-prices' for one model and context) as this ledger's rates, in
    the tier ``input_tokens`` falls in."""

    def rate(key: str, per: int = PER_MILLION) -> int | None:
        value = getattr(prices, key, None)
        if value is None:
            return None
        if hasattr(value, "tiers"):
            chosen = value.base
            for tier in reversed(value.tiers):
                if input_tokens > tier.start:
                    chosen = tier.price
                    break
            value = chosen
        # dollars per ``per`` units -> minor units per million units (or per unit)
        return _ceil_minor(Decimal(value) * PER_MILLION / per)

    plain_input, output = rate("input_mtok"), rate("output_mtok")
    if plain_input is None or output is None:
        # priced per image, per second or per request only: not by the token
        plain_input = plain_input or 0
        output = output or 0
    per_search = rate("web_searches_kcount", 1000)
    return Rates(
        input=plain_input,
        output=max(output, rate("output_reasoning_mtok") or 0),
        cached_input=rate("cache_read_mtok"),
        cache_write=rate("cache_write_mtok"),
        cache_write_1h=rate("cache_write_1h_mtok"),
        input_audio=rate("input_audio_mtok"),
        input_image=rate("input_image_mtok"),
        output_audio=rate("output_audio_mtok"),
        output_image=rate("output_image_mtok"),
        web_search=None if per_search is None else -(-per_search // PER_MILLION),
        input_character=rate("input_mchars"),
    )
