"""Drift: the ledger against a vendor's own usage and cost reports."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import click

from .._display import usd
from ..drift import (
    DEFAULT_COST_SETTLE,
    DEFAULT_SETTLE,
    DEFAULT_THRESHOLD,
    Threshold,
    check_drift,
)
from ..errors import BudgetTasksError
from ..providers.registry import registry
from ..providers.reports import BUCKETS, GROUPINGS
from . import _common
from ._common import (
    AMOUNT,
    CommandError,
    _emit,
    _table,
    json_option,
    ledger_url_option,
    main,
)

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
_DURATION = re.compile(r"(\d{1,6})([smhd])")


class Duration(click.ParamType[timedelta]):
    """``90s``, ``15m``, ``1h``, ``2d``."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        found = _DURATION.fullmatch(str(value).strip())
        if found is None:
            self.fail(f"{value!r} is not a duration such as 90s, 15m, 1h or 2d", param, ctx)
        return timedelta(**{_UNITS[found[2]]: int(found[1])})


DURATION = Duration()


def _shown(measure: str, value: int) -> str:
    return usd(value) if measure == "cost" else f"{value:,}"


def _window(line: Any) -> str:
    """A line's window in UTC: a day as its date, a minute or an hour as its start and
    width."""
    width = line.end - line.start
    if width >= timedelta(days=1):
        return f"{line.start:%Y-%m-%d}"
    return f"{line.start:%Y-%m-%d %H:%M} +{'1h' if width >= timedelta(hours=1) else '1m'}"


def _difference(measure: str, value: int) -> str:
    sign = "+" if value > 0 else "-" if value < 0 else ""
    return sign + _shown(measure, abs(value))


@main.command()
@ledger_url_option
@click.option(
    "--provider", required=True, help="The vendor whose reports to read (openai, anthropic)."
)
@click.option(
    "--since", type=DURATION, default="2d", show_default=True, help="How far back to look."
)
@click.option("--by", type=click.Choice(GROUPINGS), default=None, help="Group the lines by.")
@click.option(
    "--bucket",
    type=click.Choice(tuple(BUCKETS)),
    default="1h",
    show_default=True,
    help="Token windows (money is compared by day: the cost reports' only bucket).",
)
@click.option(
    "--settle",
    type=DURATION,
    default=f"{int(DEFAULT_SETTLE.total_seconds() // 3600)}h",
    show_default=True,
    help="How long after a window ends its report is final (before: pending, not drift).",
)
@click.option(
    "--cost-settle",
    type=DURATION,
    default=f"{int(DEFAULT_COST_SETTLE.total_seconds() // 3600)}h",
    show_default=True,
    help="The same for a day's costs (the vendors take longer to count them).",
)
@click.option(
    "--relative",
    type=click.FloatRange(0, 1, max_open=True),
    default=DEFAULT_THRESHOLD.relative,
    show_default=True,
    help="A difference of at most this share of the larger figure is not drift.",
)
@click.option(
    "--min-tokens",
    type=click.IntRange(0),
    default=DEFAULT_THRESHOLD.tokens,
    show_default=True,
    help="Nor is one of at most this many tokens.",
)
@click.option(
    "--min-cost",
    type=AMOUNT,
    default=str(DEFAULT_THRESHOLD.money),
    show_default="$0.01",
    help="Nor is one of at most this much money.",
)
@click.option("--all", "show_all", is_flag=True, help="Show the lines that agree too.")
@json_option
def drift(
    ledger_url: str,
    provider: str,
    since: timedelta,
    by: str | None,
    bucket: str,
    settle: timedelta,
    cost_settle: timedelta,
    relative: float,
    min_tokens: int,
    min_cost: int,
    show_all: bool,
    as_json: bool,
) -> None:
    """The ledger against PROVIDER's own usage and cost reports (read with its admin
    key: OPENAI_ADMIN_KEY, ANTHROPIC_ADMIN_KEY): tokens per window and money per day,
    the ledger's figure, the provider's and the difference (the provider's less the
    ledger's), attempts still open apart. Exit 1 where any line drifted."""
    vendor = registry.vendor(provider)
    ledger = _common.open_ledger(ledger_url)
    now = ledger.views.now()
    try:
        report = check_drift(
            ledger,
            vendor,
            since=now - since,
            by=by,
            bucket=bucket,
            settle=settle,
            cost_settle=cost_settle,
            threshold=Threshold(relative, min_tokens, min_cost),
        )
    except BudgetTasksError:
        raise  # one line, exit 2, as every command's
    except Exception as exc:
        # the SDK's own (unreachable, refused, timed out): exit 1 means drift, not this
        raise CommandError(
            f"{vendor.name}'s reports could not be read: {type(exc).__name__}: {exc}"
        ) from exc
    shown = [line for line in report.lines if show_all or line.status != "ok"]

    def table() -> str:
        rows = [
            [
                "total" if line.total else _window(line),
                line.group,
                line.measure.replace("_", " "),
                _shown(line.measure, line.ledger),
                _shown(line.measure, line.provider),
                _difference(line.measure, line.difference),
                str(line.open) if line.open else "",
                line.status,
            ]
            for line in shown
        ]
        head = ["window (UTC)", report.by or "group", "measure", "ledger", "provider"]
        text = _table([*head, "difference", "open", "status"], rows)
        agreed = len(report.lines) - len(shown)
        tail = [f"{agreed} line(s) agree (--all shows them)"] if agreed else []
        if not report.lines:
            tail.append("nothing was sent in this window, by the ledger or the provider's report")
        return "\n".join([text, *tail, *report.notes])

    _emit(as_json, report.as_json(), table)
    if report.drifted:
        raise SystemExit(1)
