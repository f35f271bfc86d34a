"""Rate limits: the providers' limits the fleet holds itself to (set, clear, list)."""

from __future__ import annotations

from typing import Any

import click

from .. import _validate as check
from .._display import units
from .._rate_ask import RATE_KINDS
from ..providers.registry import registry
from . import _common
from ._common import _emit, _table, json_option, ledger_url_option, main


class PerMinute(click.ParamType[int]):
    """A limit a minute: a whole number from 1 to the ledger's largest."""

    name = "count"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        # imported here: the CLI imports no ledger to print its help
        from ..ledger.rates import MOST_PER_MINUTE

        try:
            count = value if isinstance(value, int) else int(str(value).replace(",", ""))
        except ValueError:
            self.fail(f"{value!r} is not a whole number a minute", param, ctx)
        if count == 0:
            self.fail("0 a minute would admit nothing: clear the limit instead", param, ctx)
        if not 0 < count <= MOST_PER_MINUTE:
            self.fail(f"{count} is not from 1 to {MOST_PER_MINUTE:,} a minute", param, ctx)
        return count


PER_MINUTE = PerMinute()

#: The flag that lets ``limits set`` name a provider no vendor known here has.
GATEWAY_FLAG = "--gateway"


def unknown_provider(provider: str) -> str:
    """Why ``provider`` is refused: no vendor known to this process has its name."""
    known = ", ".join(sorted(v.name for v in registry.vendors()))
    return (
        f"no provider named {provider!r} is known here ({known}): for a gateway's own name "
        f"give {GATEWAY_FLAG}; for a vendor your app registers, name the app with -A"
    )


def _windows_table(windows: list[Any]) -> str:
    rows = [
        [w.provider, w.scope, w.kind, units(w.per_minute), units(w.available), w.booked]
        for w in windows
    ]
    headers = ["provider", "scope", "kind", "limit / min", "available", "booked"]
    text = _table(headers, rows)
    return text if windows else text + "\nno rate limits are set"


@main.group()
def limits() -> None:
    """Set, clear and list the providers' rate limits, held in the ledger for every
    worker (per provider and scope: a model, a group of models, *, key:HINT)."""


@limits.command("set")
@ledger_url_option
@click.argument("provider")
@click.argument("scope")
@click.option("--requests", type=PER_MINUTE, default=None, help="Requests a minute.")
@click.option("--tokens", type=PER_MINUTE, default=None, help="Tokens a minute.")
@click.option("--input-tokens", type=PER_MINUTE, default=None, help="Input tokens a minute.")
@click.option("--output-tokens", type=PER_MINUTE, default=None, help="Output tokens a minute.")
@click.option(
    GATEWAY_FLAG,
    "gateway",
    is_flag=True,
    help="PROVIDER is a name no vendor known here has (a gateway your workers register "
    "as a vendor of its own): set its limits anyway.",
)
@json_option
def limits_set(
    ledger_url: str,
    provider: str,
    scope: str,
    requests: int | None,
    tokens: int | None,
    input_tokens: int | None,
    output_tokens: int | None,
    gateway: bool,
    as_json: bool,
) -> None:
    """Hold PROVIDER's SCOPE to each limit given (a new one starts full; a changed one
    keeps what it holds, never more than its new limit). Limits not given stay.

    PROVIDER is a vendor known here (openai, anthropic, or one the app of -A
    registers); any other name needs --gateway."""
    given = dict(zip(RATE_KINDS, (requests, tokens, input_tokens, output_tokens), strict=True))
    chosen = {kind: n for kind, n in given.items() if n is not None}
    if not chosen:
        raise click.UsageError(
            "give at least one of --requests, --tokens, --input-tokens, --output-tokens"
        )
    check.text(provider, "provider", max_length=64)
    if not gateway and registry.find(provider) is None:
        # only calls sent through a vendor of this name take from its windows: a typo
        # would hold nothing, so it is refused before anything is set
        raise click.UsageError(unknown_provider(provider))
    rates = _common.open_ledger(ledger_url).rates
    # every value was checked by click before this line: a bad one sets none of them
    for kind, per_minute in chosen.items():
        rates.set_limit(provider, scope, kind, per_minute)
    shown = [w for w in rates.windows() if (w.provider, w.scope) == (provider, scope)]
    _emit(
        as_json,
        shown,
        lambda: (
            f"set {provider} {scope}: "
            + ", ".join(f"{kind} {per_minute:,} a minute" for kind, per_minute in chosen.items())
        ),
    )


@limits.command("clear")
@ledger_url_option
@click.argument("provider")
@click.argument("scope")
@click.option("--kind", type=click.Choice(RATE_KINDS), default=None, help="Only this limit.")
@json_option
def limits_clear(
    ledger_url: str, provider: str, scope: str, kind: str | None, as_json: bool
) -> None:
    """Stop holding PROVIDER's SCOPE to its limits (or to --kind only); says how many
    went."""
    gone = _common.open_ledger(ledger_url).rates.clear_limit(provider, scope, kind)
    data = {"provider": provider, "scope": scope, "kind": kind, "cleared": gone}
    of = f"{provider} {scope}" + (f" {kind}" if kind else "")
    _emit(as_json, data, lambda: f"cleared {gone} limit(s) of {of}")


@limits.command("list")
@ledger_url_option
@json_option
def limits_list(ledger_url: str, as_json: bool) -> None:
    """Every limit set: its limit a minute, what it holds now (below 0: owed to the
    calls booked ahead) and how many calls are booked ahead on it."""
    windows = _common.open_ledger(ledger_url).rates.windows()
    _emit(as_json, windows, lambda: _windows_table(windows))


class Weight(click.ParamType[int | None]):
    """A tenant's weight in the rate windows it shares: 1 to 1000, or ``none``."""

    name = "weight"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..ledger.budgets import MOST_RATE_WEIGHT

        if value is None or isinstance(value, int):
            return value
        if str(value).strip().lower() == "none":
            return None
        text = str(value).strip()
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MOST_RATE_WEIGHT:
            self.fail(
                f"{value!r} is not a weight from 1 to {MOST_RATE_WEIGHT}, or none", param, ctx
            )
        return int(text)


@limits.command("weight")
@ledger_url_option
@click.argument("budget")
@click.argument("weight", type=Weight())
@json_option
def limits_weight(ledger_url: str, budget: str, weight: int | None, as_json: bool) -> None:
    """Give BUDGET a WEIGHT (1 to 1000, or none) in the rate windows its calls share:
    where tenants' calls wait in one window's line, each gets its weight's part while
    the others wait. The budgets under it that have no weight of their own are part of
    it; a budget with none anywhere above it is a tenant of weight 1."""
    _common.open_ledger(ledger_url).rates.set_weight(budget, weight)
    data = {"budget": budget, "rate_weight": weight}
    said = f"weight {weight}" if weight is not None else "no weight of its own"
    _emit(as_json, data, lambda: f"{budget}: {said} in the rate windows its calls share")
