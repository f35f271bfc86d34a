"""The ledger at a glance: status, and the dashboard."""

from __future__ import annotations

import click

from .._display import usd
from . import _common
from ._common import (
    CommandError,
    _age,
    _emit,
    _frozen_by,
    _frozen_suffix,
    _table,
    json_option,
    ledger_url_option,
    main,
)


@main.command()
@ledger_url_option
@json_option
def status(ledger_url: str, as_json: bool) -> None:
    """Every budget's current period: cap, spent and held (the budgets below it
    included), granted (held unused by escrowed budgets below), available, usable (what
    it can admit now: no more than its parents can give), oldest hold."""
    ledger = _common.open_ledger(ledger_url)
    frozen_by = _frozen_by(ledger.budgets())
    rows = [
        {
            "budget": r.budget,
            "cap": r.cap,
            "spent": r.spent,
            "held": r.held,
            "available": r.available,
            "usable": r.usable,
            "oldest_hold": r.oldest_hold,
            "frozen": r.frozen,
            "frozen_by": frozen_by.get(r.budget),
            "overrun": r.overrun,
            "granted": r.granted,
            "drawn": r.drawn,
        }
        for r in ledger.report()
    ]
    _emit(
        as_json,
        rows,
        lambda: _table(
            ["budget", "cap", "spent", "held", "granted", "available", "usable", "oldest hold"],
            [
                [
                    r["budget"] + _frozen_suffix(r["budget"], r["frozen_by"]),
                    usd(r["cap"]),
                    usd(r["spent"]),
                    usd(r["held"]),
                    usd(r["granted"]),
                    usd(r["available"]),
                    usd(r["usable"]),
                    _age(r["oldest_hold"]),
                ]
                for r in rows
            ],
        ),
    )


@main.command()
@ledger_url_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8090, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    help="A Host name the page may be asked for besides the local ones (repeat; * for any).",
)
def dashboard(ledger_url: str, host: str, port: int, allow_hosts: tuple[str, ...]) -> None:
    """Serve the operator's web page until Ctrl-C: budgets, spend over time, holds, the
    unknown outcomes waiting for a person, operations; JSON and CSV behind each view.
    Resolving and reopening need env BUDGET_TASKS_DASHBOARD_TOKEN (without it the page
    is read-only). Needs the extra: pip install 'budget-tasks[dashboard]'."""
    try:
        import uvicorn

        from ..dashboard.app import TOKEN_ENV, create_app, token_from_env
    except ImportError as exc:
        raise CommandError(
            f"the dashboard needs its extra: pip install 'budget-tasks[dashboard]' ({exc.name})"
        ) from exc
    token = token_from_env()
    app = create_app(_common.open_ledger(ledger_url), token=token, hosts=(*allow_hosts, host))
    mode = "resolving and reopening with the token" if token else f"read-only (no {TOKEN_ENV})"
    click.echo(f"dashboard on http://{host}:{port}/ ({mode}); Ctrl-C stops it", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
