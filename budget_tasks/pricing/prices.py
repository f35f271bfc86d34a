"""Which prices a process uses: your own table (contract prices) first, then the
maintained source for every model it does not name."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Protocol

from .. import _validate as check
from ..errors import UnknownModelPrice
from .maintained import MaintainedPrices
from .rates import Estimating, Rates
from .table import PriceTable, load_prices
from .usage import STANDARD, Estimate, PriceContext, Usage

#: The environment variable naming your own price table (a JSON file).
PRICES_ENV = "BUDGET_TASKS_PRICES"


class Prices(Protocol):
    """What the estimates, the settlements and the fake provider ask of prices."""

    @property
    def version(self) -> str: ...

    def knows(self, model: str, provider: str | None = None) -> bool: ...

    def rates(
        self,
        model: str,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
        input_tokens: int = 0,
    ) -> Rates: ...

    def cost(
        self,
        model: str,
        usage: Usage,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
    ) -> int: ...

    def estimate(
        self,
        model: str,
        prompt: Iterable[str],
        max_output_tokens: int | None,
        *,
        choices: int = 1,
        extra_input_tokens: int = 0,
        extra_output_tokens: int = 0,
        provider: str | None = None,
        context: PriceContext = STANDARD,
        cache: str | None = "5m",
        images: bool = False,
    ) -> Estimate: ...


class Pricing(Estimating):
    """``override`` (your own :class:`PriceTable`) for the models it names, the
    maintained source for the rest. An unknown model raises UnknownModelPrice."""

    def __init__(self, override: PriceTable | None = None, source: Prices | None = None) -> None:
        self.override = override
        self.source: Prices = source if source is not None else MaintainedPrices()
        self.version = (
            self.source.version if override is None else f"{override.version}+{self.source.version}"
        )[:64]

    def _for(self, model: str, provider: str | None) -> Prices:
        check.text(model, "model", max_length=200)
        if self.override is not None and self.override.knows(model, provider):
            return self.override
        return self.source

    def knows(self, model: str, provider: str | None = None) -> bool:
        """Whether ``model`` has a price (a name that is no model's has none)."""
        try:
            return self._for(model, provider).knows(model, provider)
        except (TypeError, ValueError):
            return False

    def rates(
        self,
        model: str,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
        input_tokens: int = 0,
    ) -> Rates:
        try:
            return self._for(model, provider).rates(
                model, provider=provider, context=context, input_tokens=input_tokens
            )
        except UnknownModelPrice:
            raise UnknownModelPrice(model, self.version) from None

    def cost(
        self,
        model: str,
        usage: Usage,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
    ) -> int:
        try:
            return self._for(model, provider).cost(model, usage, provider=provider, context=context)
        except UnknownModelPrice:
            raise UnknownModelPrice(model, self.version) from None


_default: Pricing | None = None
_default_lock = threading.Lock()


def default_prices() -> Pricing:
    """This process's prices: the maintained source, under your own table when the
    environment names one (``BUDGET_TASKS_PRICES=/path/to/prices.json``). Loaded once."""
    global _default
    with _default_lock:
        if _default is None:
            path = os.environ.get(PRICES_ENV)
            _default = Pricing(load_prices(path) if path else None)
        return _default


def set_default_prices(prices: Pricing | None) -> None:
    """Replace this process's prices (None: read them again on next use)."""
    global _default
    with _default_lock:
        _default = prices
