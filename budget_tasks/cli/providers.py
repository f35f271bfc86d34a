"""What the library knows of the providers: their billable rules and prices."""

from __future__ import annotations

import dataclasses

import click

from ..errors import BudgetTasksError
from ._common import (
    CommandError,
    _emit,
    _first_line,
    _table,
    json_option,
    main,
)


@main.command()
@click.option("--vendor", "vendor_name", default=None, help="Only this vendor's rules.")
@json_option
def providers(vendor_name: str | None, as_json: bool) -> None:
    """What each vendor's POSTs are: metered, free or refused, and why (the rules the
    guarded transport judges a request by; anything they do not name is refused)."""
    from ..providers import registry

    try:
        vendors = [registry.vendor(vendor_name)] if vendor_name else registry.vendors()
    except BudgetTasksError as exc:
        raise CommandError(_first_line(exc)) from exc
    rows = [
        {
            "vendor": v.name,
            "pattern": rule.pattern,
            "kind": rule.kind.value,
            "endpoint": rule.endpoint.name if rule.endpoint else None,
            "why": rule.why,
        }
        for v in vendors
        for rule in v.rules
    ]
    _emit(
        as_json,
        rows,
        lambda: _table(
            ["vendor", "kind", "path", "why"],
            [[r["vendor"], r["kind"], r["pattern"], r["why"]] for r in rows],
        ),
    )


@main.command()
@click.argument("model")
@click.option("--vendor", "vendor_name", default=None, help="The vendor it is priced at.")
@click.option("--tier", default=None, help="A service tier (priority, flex, ...).")
@click.option("--batch", is_flag=True, help="The batch price.")
@json_option
def price(
    model: str, vendor_name: str | None, tier: str | None, batch: bool, as_json: bool
) -> None:
    """A model's rates in micro-USD per million tokens, as settlements price it (your
    own table, BUDGET_TASKS_PRICES, over the maintained prices)."""
    from ..pricing import default_prices
    from ..pricing.usage import PriceContext

    prices = default_prices()
    try:
        rates = prices.rates(
            model, provider=vendor_name, context=PriceContext(service_tier=tier, batch=batch)
        )
    except (BudgetTasksError, TypeError, ValueError) as exc:
        raise CommandError(_first_line(exc)) from exc
    data = {"model": model, "version": prices.version, **dataclasses.asdict(rates)}
    _emit(
        as_json,
        data,
        lambda: (
            f"{model} ({prices.version}), micro-USD per million tokens\n"
            + _table(["rate", "value"], [[k, v] for k, v in dataclasses.asdict(rates).items()])
        ),
    )
