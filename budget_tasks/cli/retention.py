"""Retention: what leaves the database, and running it."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import click

from . import _common
from ._common import (
    ARCHIVE_ENV,
    ARCHIVE_SETTING,
    RETENTION_ENV,
    RETENTION_SETTING,
    CommandError,
    _app_setting,
    _emit,
    _table,
    json_option,
    ledger_url_option,
    main,
)


def _setting_or(ctx: click.Context, value: Any, setting: str, env: str) -> Any:
    """An option, else env ``env``, else the ``-A`` app's ``setting`` (None: none)."""
    if value is None:
        value = os.environ.get(env) or None
    if value is None:
        value = _app_setting(ctx, setting)
    return value


def _keep_days(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    found = _setting_or(ctx, value, RETENTION_SETTING, RETENTION_ENV)
    try:
        return None if found is None else float(found)
    except (TypeError, ValueError) as exc:
        raise CommandError(f"the retention window is not a number of days: {found!r}") from exc


def _archive_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    found = _setting_or(ctx, value, ARCHIVE_SETTING, ARCHIVE_ENV)
    return None if found is None else str(found)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


keep_days_option = click.option(
    "--keep-days",
    type=float,
    default=None,
    callback=_keep_days,
    help=f"The retention window in days (else env {RETENTION_ENV}, else -A's {RETENTION_SETTING}).",
)


@main.group()
def retention() -> None:
    """The journal's partitions and what retention archives (PostgreSQL)."""


@retention.command("show")
@ledger_url_option
@keep_days_option
@json_option
def retention_show(ledger_url: str, keep_days: float | None, as_json: bool) -> None:
    """Each partition: its month, rows, size, and what the next run does with it."""
    ledger = _common.open_ledger(ledger_url)
    keep = None if keep_days is None else timedelta(days=keep_days)
    parts = ledger.upkeep.retention(keep)
    due = [p for p in parts if p.state == "due"]
    window = "no retention window: every row is kept" if keep is None else f"{keep_days:g} days"

    def render() -> str:
        table = _table(
            ["partition", "month", "state", "rows", "size", "why / where"],
            [
                [
                    p.name,
                    "" if p.month is None else p.month.strftime("%Y-%m"),
                    p.state,
                    "?" if p.rows is None else f"~{p.rows:,}" if p.state != "archived" else p.rows,
                    "" if p.state == "archived" else _mib(p.bytes),
                    "; ".join(p.blockers) or (p.kept_as or ""),
                ]
                for p in parts
            ],
        )
        nxt = ", ".join(p.name for p in due) or "nothing"
        return f"{table}\nretention: {window}; the next run archives {nxt}"

    _emit(as_json, {"keep_days": keep_days, "partitions": parts}, render)


@retention.command("run")
@ledger_url_option
@keep_days_option
@click.option(
    "--archive-to",
    default=None,
    callback=_archive_dir,
    help=f"The directory archived months are written to (else env {ARCHIVE_ENV}, else "
    f"-A's {ARCHIVE_SETTING}).",
)
@json_option
def retention_run(
    ledger_url: str, keep_days: float | None, archive_to: str | None, as_json: bool
) -> None:
    """Archive the settled months past the window, then remove their attempts and the
    finished operations past it; exit 1 if a month past the window was kept."""
    if keep_days is None:
        raise CommandError("no retention window: give --keep-days (or set it)")
    if archive_to is None:
        raise CommandError("no archive directory: give --archive-to (or set it)")
    ledger = _common.open_ledger(ledger_url)
    done = ledger.upkeep.retain(timedelta(days=keep_days), archive_to=archive_to)

    def render() -> str:
        lines = [f"archived {name} to {archive_to}" for name in done.archived]
        lines += [f"kept {name}: {'; '.join(why)}" for name, why in done.blocked.items()]
        lines.append(f"removed {done.attempts:,} attempts and {done.operations:,} operations")
        return "\n".join(lines)

    _emit(as_json, done, render)
    if done.blocked:
        sys.exit(1)
