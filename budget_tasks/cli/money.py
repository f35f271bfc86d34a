"""The money's record: holds, corrections, resolutions, actions, the audit."""

from __future__ import annotations

import sys
from datetime import timedelta

import click

from .._display import usd
from . import _common
from ._common import (
    AMOUNT,
    DEFAULT_STALE_AFTER_S,
    SIGNED_AMOUNT,
    STALE_AFTER_ENV,
    STALE_AFTER_SETTING,
    CommandError,
    _age,
    _app_setting,
    _duration,
    _emit,
    _plain,
    _short,
    _table,
    by_option,
    json_option,
    ledger_url_option,
    main,
)


@main.command()
@ledger_url_option
@click.argument("attempt")
@click.option(
    "--delta",
    type=SIGNED_AMOUNT,
    required=True,
    help="Dollars (1.25usd) or micro-USD: + charges more, - refunds.",
)
@click.option("--reason", required=True, help="Why (recorded in the journal).")
@click.option("--ref", default=None, help="The provider's reference: the same ref applies once.")
@by_option
@json_option
def adjust(
    ledger_url: str,
    attempt: str,
    delta: int,
    reason: str,
    ref: str | None,
    by: str | None,
    as_json: bool,
) -> None:
    """A provider's correction to a settled attempt's charge, as a journal entry."""
    ledger = _common.open_ledger(ledger_url)
    applied = ledger.adjust(attempt, delta, reason, ref=ref, actor=by)
    after = ledger.attempt(attempt)
    _emit(
        as_json,
        {**_plain(after), "applied": applied},
        lambda: (
            f"{attempt}: {'adjusted by' if applied else 'already adjusted (ref seen):'} "
            f"{'+' if delta >= 0 else ''}{usd(delta)} ({reason})"
        ),
    )


def _stale_age(ctx: click.Context, param: click.Parameter, value: float | None) -> float:
    """--age, else env, else the app's ``budget_stale_after``, else 900 s."""
    if value is None:
        setting = _app_setting(ctx, STALE_AFTER_SETTING)
        try:
            value = DEFAULT_STALE_AFTER_S if setting is None else float(setting)
        except (TypeError, ValueError) as exc:
            raise CommandError(
                f"the Celery app's {STALE_AFTER_SETTING} is not a number: {setting!r}"
            ) from exc
    return _duration(value)


@main.command()
@ledger_url_option
@click.option(
    "--stale",
    is_flag=True,
    help="Only sends with an unknown outcome (sending/unknown) past --age, or that the "
    "beat job flagged stale.",
)
@click.option(
    "--age",
    type=float,
    envvar=STALE_AFTER_ENV,
    default=None,
    callback=_stale_age,
    help=f"Seconds after which such a hold counts as stale (else env {STALE_AFTER_ENV}, "
    f"else -A's {STALE_AFTER_SETTING}, else {DEFAULT_STALE_AFTER_S:.0f}).",
)
@click.option("--budget", "budget_name", default=None, help="Only this budget's holds.")
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="Holds of 0 too (a task's main attempt whose calls each reserve their own).",
)
@json_option
def holds(
    ledger_url: str,
    stale: bool,
    age: float,
    budget_name: str | None,
    show_all: bool,
    as_json: bool,
) -> None:
    """Money still held, oldest first, with its age."""
    ledger = _common.open_ledger(ledger_url)
    if budget_name is not None:
        ledger.budget(budget_name)  # an unknown budget is an error, not an empty table
    if not stale:
        found = ledger.holds(budget=budget_name)
    else:
        # The beat job flags by its app's age, which may not be this one: what it flagged
        # is stale whatever its age here.
        limit = timedelta(seconds=age)
        found = [
            h
            for h in ledger.holds(states=("sending", "unknown"), budget=budget_name)
            if h.flagged_at is not None or h.age >= limit
        ]
    if not show_all:
        found = [h for h in found if h.amount != 0]
    _emit(
        as_json,
        found,
        lambda: _table(
            ["attempt", "budget", "state", "amount", "age", "request id", "flagged"],
            [
                [
                    h.key,
                    h.budget,
                    h.state,
                    usd(h.amount),
                    _age(h.age),
                    h.request_id,
                    "yes" if h.flagged_at else "no",
                ]
                for h in found
            ],
        ),
    )


@main.command()
@ledger_url_option
@click.argument("attempt")
@click.option(
    "--actual",
    type=AMOUNT,
    required=True,
    help="What the provider charged: dollars (0.04usd) or micro-USD (0: nothing).",
)
@click.option("--note", required=True, help="Why: recorded in the journal.")
@by_option
@json_option
def resolve(
    ledger_url: str, attempt: str, actual: int, note: str, by: str | None, as_json: bool
) -> None:
    """An operator's settlement (or, with --actual 0, release) of a held attempt."""
    from ..resolution import NeverSent, resolve_outcome

    # Compare-and-set on the state shown to the operator: if it moved since, nothing
    # changes and the command says so (the dashboard resolves by the same function).
    try:
        resolution = resolve_outcome(_common.open_ledger(ledger_url), attempt, actual, note, by)
    except NeverSent as exc:
        raise click.UsageError(str(exc)) from exc
    before, done, after = resolution.before, resolution.done, resolution.after

    def text() -> str:
        line = f"{attempt}: {before.state} -> {after.state}, charged {usd(after.actual)}"
        if not done.applied:
            line += " (already so: nothing changed)"
        if done.operation is not None:
            if done.operation_status is None:
                line += f"; operation {done.operation} not changed (a later attempt exists)"
            elif done.operation_changed:
                line += f"; operation {done.operation} now {done.operation_status}"
            else:
                line += f"; operation {done.operation} stays {done.operation_status}"
        return line

    payload = {
        **_plain(after),
        "operation": done.operation,
        "operation_status": done.operation_status,
    }
    _emit(as_json, payload, text)


@main.command()
@ledger_url_option
@click.option("--budget", "budget_name", default=None, help="Only this budget's periods.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@json_option
def actions(ledger_url: str, budget_name: str | None, limit: int, as_json: bool) -> None:
    """What operators did, newest first: who resolved, adjusted, changed a cap,
    froze, unfroze or reopened what, and why (the journal's own rows)."""
    done = _common.open_ledger(ledger_url).actions(budget=budget_name, limit=limit)
    _emit(
        as_json,
        done,
        lambda: _table(
            ["when", "by", "kind", "budget", "attempt", "spent", "note"],
            [
                [
                    e.created_at.isoformat(timespec="seconds"),
                    e.actor,
                    e.kind,
                    e.budget,
                    e.attempt,
                    usd(e.spent_delta),
                    _short(e.note),
                ]
                for e in done
            ],
        ),
    )


@main.command()
@ledger_url_option
@click.option(
    "--full",
    is_flag=True,
    default=False,
    help="Read the whole journal and prove every period (default: the open periods and "
    "those with journal rows since the last audit).",
)
@json_option
def audit(ledger_url: str, full: bool, as_json: bool) -> None:
    """Check the counters against the journal; exit 1 on any difference."""
    ledger = _common.open_ledger(ledger_url)
    reads = ledger.upkeep.audit_size(full=full)
    click.echo(
        f"audit{' (full)' if full else ''}: reading {'about ' if full else ''}{reads:,} "
        "journal rows",
        err=True,
    )
    findings = ledger.audit(full=full)
    _emit(
        as_json,
        findings,
        lambda: (
            "audit: every counter equals its journal"
            if not findings
            else _table(
                ["budget", "period", "counter", "recorded", "journal"],
                [
                    [f.budget, f.period_start.date(), f.counter, usd(f.recorded), usd(f.journal)]
                    for f in findings
                ],
            )
        ),
    )
    if findings:
        sys.exit(1)
