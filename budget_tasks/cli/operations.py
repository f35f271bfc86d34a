"""Operations: list them, show one, reopen a failed one."""

from __future__ import annotations

import json

import click

from .._display import usd
from . import _common
from ._common import (
    _emit,
    _short,
    _table,
    by_option,
    json_option,
    ledger_url_option,
    main,
)


@main.group()
def operations() -> None:
    """List operations, show one's attempts, journal and result, reopen a failed one."""


@operations.command("list")
@ledger_url_option
@click.option(
    "--status",
    type=click.Choice(["pending", "running", "succeeded", "failed", "unknown", "retryable"]),
    default=None,
    help="Only operations in this status.",
)
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=100, show_default=True, help="At most."
)
@json_option
def operations_list(ledger_url: str, status: str | None, limit: int, as_json: bool) -> None:
    """Operations, the most recently changed first. "unfinished runs" counts runs
    that took the lease and never recorded their end (killed workers): 0 once it ends."""
    found = _common.open_ledger(ledger_url).operations(status=status, limit=limit)
    _emit(
        as_json,
        found,
        lambda: _table(
            ["operation", "status", "task", "unfinished runs", "deliveries", "replays", "error"],
            [
                [o.key, o.status, o.task, o.runs, o.deliveries, o.replays, _short(o.error)]
                for o in found
            ],
        ),
    )


@operations.command("show")
@ledger_url_option
@click.argument("key")
@json_option
def operations_show(ledger_url: str, key: str, as_json: bool) -> None:
    """One operation: its status and stored result, its attempts with their holds, the
    journal entries they wrote, and what operators did to it."""
    history = _common.open_ledger(ledger_url).operation_history(key)
    op = history.operation

    def text() -> str:
        lines = [
            f"operation {op.key}: {op.status}"
            + (f" (task {op.task})" if op.task else "")
            + f", {op.deliveries} deliveries, {op.replays} replays",
        ]
        if op.error:
            lines.append(f"error: {_short(op.error, 200)}")
        if op.result is not None:
            lines.append(f"result: {_short(json.dumps(op.result), 200)}")
        lines += ["", "attempts:"]
        lines.append(
            _table(
                ["attempt", "state", "reason", "amount", "actual", "request id"],
                [
                    [a.key, a.state, a.reason, usd(a.amount), usd(a.actual), a.request_id]
                    for a in history.attempts
                ],
            )
        )
        lines += ["", "journal:"]
        lines.append(
            _table(
                ["attempt", "budget", "kind", "held", "spent", "note"],
                [
                    [
                        e.attempt,
                        e.budget,
                        e.kind,
                        usd(e.held_delta),
                        usd(e.spent_delta),
                        _short(e.note),
                    ]
                    for e in history.journal
                ],
            )
        )
        for event in history.events:
            lines.append(
                f"{event.created_at.isoformat()} {event.kind} by {event.by}: "
                f"{event.from_status} -> {event.to_status} ({_short(event.note)})"
            )
        return "\n".join(lines)

    _emit(as_json, history, text)


@operations.command("reopen")
@ledger_url_option
@click.argument("key")
@click.option("--reason", required=True, help="Why (recorded with the operation).")
@by_option
@json_option
def operations_reopen(
    ledger_url: str, key: str, reason: str, by: str | None, as_json: bool
) -> None:
    """Reopen a failed operation: its next delivery runs it again (calls whose results
    were stored replay; the others are sent again as new attempts). Refused while any of
    its calls holds money."""
    op = _common.open_ledger(ledger_url).reopen_operation(key, reason=reason, by=by)
    _emit(
        as_json,
        op,
        lambda: f"operation {key}: failed -> {op.status}; enqueue it again to run it",
    )
