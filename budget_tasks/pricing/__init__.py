"""Prices and estimates in integer minor units (micro-USD by default).

Prices come from a maintained source (:mod:`~budget_tasks.pricing.maintained`: Pydantic's
``genai-prices``, which knows snapshot ids, cache writes by TTL, service tiers, batch
prices and price changes over time), under your own table of contract prices where you
give one (:mod:`~budget_tasks.pricing.table`, ``BUDGET_TASKS_PRICES``). Costs round up
to a whole minor unit; estimates are upper bounds (:mod:`~budget_tasks.pricing.rates`).
"""

from .maintained import MaintainedPrices
from .prices import Prices, default_prices, set_default_prices
from .table import ModelPrice, PriceTable, load_prices
from .usage import Estimate, Usage

__all__ = [
    "Estimate",
    "MaintainedPrices",
    "ModelPrice",
    "PriceTable",
    "Prices",
    "Usage",
    "default_prices",
    "load_prices",
    "set_default_prices",
]
