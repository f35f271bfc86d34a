"""Budgets: create, list, show, freeze, change the cap or the slices."""

from __future__ import annotations

import click

from .._display import usd
from . import _common
from ._common import (
    AMOUNT,
    _emit,
    _frozen_by,
    _frozen_text,
    _plain,
    _table,
    by_option,
    json_option,
    ledger_url_option,
    main,
    note_option,
)


@main.group()
def budget() -> None:
    """Create, list, show, freeze and unfreeze budgets, and set their caps."""


@budget.command("create")
@ledger_url_option
@click.argument("name")
@click.option(
    "--cap", type=AMOUNT, required=True, help="Per period: dollars (50usd) or micro-USD (50000000)."
)
@click.option(
    "--period",
    type=click.Choice(["none", "day", "week", "month"]),
    default="none",
    show_default=True,
    help="How often the cap renews (UTC calendar periods); none: one cap for all time.",
)
@click.option(
    "--parent",
    default=None,
    help="A budget this one spends from: every admission here also counts there.",
)
@click.option("--tenant", default=None, help="Whose budget it is (a label for reports).")
@click.option(
    "--renewal",
    type=click.Choice(["reset", "rollover"]),
    default="reset",
    show_default=True,
    help="A new period starts at the cap (reset), or carries what was left (rollover).",
)
@click.option(
    "--rollover-ceiling",
    type=AMOUNT,
    default=None,
    # the ledger's DEFAULT_ROLLOVER_MULTIPLE, written out: the CLI imports no ledger
    # to print its help (a test holds the two together)
    help="The most a rolled-over period may open with (dollars or micro-USD); default: 3x the cap.",
)
@click.option(
    "--escrow",
    is_flag=True,
    default=False,
    help="Admit against grants drawn from the parent instead of writing the parent on "
    "every call (for many tenants under one parent); chosen now, never changed.",
)
@click.option(
    "--slices",
    type=int,
    default=1,
    show_default=True,
    help="Split the budget's money over this many rows that share its cap (for one budget "
    "many workers admit on at once); see budget set-slices.",
)
@json_option
def budget_create(
    ledger_url: str,
    name: str,
    cap: int,
    period: str,
    parent: str | None,
    tenant: str | None,
    renewal: str,
    rollover_ceiling: int | None,
    escrow: bool,
    slices: int,
    as_json: bool,
) -> None:
    """Create a budget."""
    info = _common.open_ledger(ledger_url).create_budget(
        name,
        cap,
        period=period,
        parent=parent,
        tenant=tenant,
        renewal=renewal,
        rollover_ceiling=rollover_ceiling,
        escrow=escrow,
        slices=slices,
    )
    per = ", no period" if info.period == "none" else f" per {info.period}"
    _emit(as_json, info, lambda: f"created budget {info.name}: cap {usd(info.cap)}{per}")


@budget.command("list")
@ledger_url_option
@json_option
def budget_list(ledger_url: str, as_json: bool) -> None:
    """All budgets and their configuration (frozen: yes, or by the ancestor whose
    freeze stops it)."""
    budgets = _common.open_ledger(ledger_url).budgets()
    frozen_by = _frozen_by(budgets)
    _emit(
        as_json,
        [{**_plain(b), "frozen_by": frozen_by[b.name]} for b in budgets],
        lambda: _table(
            ["budget", "cap", "period", "renewal", "parent", "tenant", "frozen"],
            [
                [
                    b.name,
                    usd(b.cap),
                    b.period,
                    b.renewal,
                    b.parent,
                    b.tenant,
                    _frozen_text(b.name, frozen_by[b.name]),
                ]
                for b in budgets
            ],
        ),
    )


@budget.command("show")
@ledger_url_option
@click.argument("name")
@json_option
def budget_show(ledger_url: str, name: str, as_json: bool) -> None:
    """One budget: configuration, current balance and open holds."""
    ledger = _common.open_ledger(ledger_url)
    info, bal, holds = ledger.budget(name), ledger.balance(name), ledger.holds(budget=name)
    frozen_by = _frozen_by(ledger.budgets())[name]
    # what it can admit now, its parents' room counted (the report's figure)
    usable = next((r.usable for r in ledger.report() if r.budget == name), bal.available)
    data = {
        "budget": {**_plain(info), "frozen_by": frozen_by},
        "balance": bal,
        "usable": usable,
        "holds": holds,
    }
    _emit(
        as_json,
        data,
        lambda: "\n".join(
            [
                f"budget {info.name} ("
                + (
                    "no period"  # one period for all time: renewal never applies
                    if info.period == "none"
                    else f"period {info.period}, renewal {info.renewal}"
                )
                + (f", parent {info.parent}" if info.parent else "")
                + (", escrow" if info.escrow else "")
                + (f", {info.slices} slices" if info.slices > 1 else "")
                + (", FROZEN" if info.frozen else "")
                + (f", FROZEN by {frozen_by}" if frozen_by not in (None, name) else "")
                + ")",
                (
                    "all time"
                    if info.period == "none"
                    else f"period from {bal.period_start.isoformat()}"
                )
                + f": cap {usd(bal.cap)}, spent {usd(bal.spent)}, held {usd(bal.held)}, "
                + (f"unused grants below {usd(bal.granted)}, " if bal.granted else "")
                + (f"drawn {usd(bal.drawn)}, " if info.escrow else "")
                + f"available {usd(bal.available)}"
                + (f", usable {usd(usable)}" if usable != bal.available else ""),
                f"open holds: {len(holds)}",
            ]
        ),
    )


def _set_frozen(
    ledger_url: str, name: str, frozen: bool, note: str | None, by: str | None, as_json: bool
) -> None:
    ledger = _common.open_ledger(ledger_url)
    (ledger.freeze if frozen else ledger.unfreeze)(name, note=note, actor=by)
    info = ledger.budget(name)
    _emit(as_json, info, lambda: f"budget {name} {'frozen' if frozen else 'unfrozen'}")


@budget.command("freeze")
@ledger_url_option
@click.argument("name")
@note_option
@by_option
@json_option
def budget_freeze(
    ledger_url: str, name: str, note: str | None, by: str | None, as_json: bool
) -> None:
    """Stop all admission on a budget and its descendants."""
    _set_frozen(ledger_url, name, True, note, by, as_json)


@budget.command("unfreeze")
@ledger_url_option
@click.argument("name")
@note_option
@by_option
@json_option
def budget_unfreeze(
    ledger_url: str, name: str, note: str | None, by: str | None, as_json: bool
) -> None:
    """Admit again."""
    _set_frozen(ledger_url, name, False, note, by, as_json)


@budget.command("set-cap")
@ledger_url_option
@click.argument("name")
@click.option(
    "--cap", type=AMOUNT, required=True, help="The new cap per period: dollars or micro-USD."
)
@note_option
@by_option
@json_option
def budget_set_cap(
    ledger_url: str, name: str, cap: int, note: str | None, by: str | None, as_json: bool
) -> None:
    """Raise or lower a budget's cap; never below what its period has spent and holds."""
    ledger = _common.open_ledger(ledger_url)
    before = ledger.budget(name).cap
    info = ledger.set_cap(name, cap, note=note, actor=by)
    _emit(as_json, info, lambda: f"budget {name}: cap {usd(before)} -> {usd(info.cap)}")


@budget.command("set-slices")
@ledger_url_option
@click.argument("name")
@click.argument("slices", type=int)
@json_option
def budget_set_slices(ledger_url: str, name: str, slices: int, as_json: bool) -> None:
    """Split a budget's money over SLICES rows that share its cap (1: one row)."""
    info = _common.open_ledger(ledger_url).set_slices(name, slices)
    _emit(as_json, info, lambda: f"budget {name}: {info.slices} slices")
