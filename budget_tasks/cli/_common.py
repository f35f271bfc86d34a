"""What every command shares: the root group (``-A``, ``--ledger-url``), loading the
user's Celery app, opening the ledger, the options, tables and JSON output."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import IO, Any

import click

from .._display import age, amount
from ..config import LEDGER_URL_ENV, LEDGER_URL_SETTING

STALE_AFTER_SETTING = "budget_stale_after"
RETENTION_SETTING = "budget_ledger_retention_days"
RETENTION_ENV = "BUDGET_TASKS_LEDGER_RETENTION_DAYS"
ARCHIVE_SETTING = "budget_archive_dir"
ARCHIVE_ENV = "BUDGET_TASKS_ARCHIVE_DIR"
STALE_AFTER_ENV = "BUDGET_TASKS_STALE_AFTER"
#: What the beat job flags by when the app does not say (beat.py, the demo settings).
DEFAULT_STALE_AFTER_S = 900.0


class CommandError(click.ClickException):
    """One line on stderr and exit code 2, as :func:`run` reports the library's errors."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {_safe(self.format_message())}", file=file, err=True)


class Amount(click.ParamType[int]):
    """Money as a person types it: ``50usd``, ``$0.25`` or whole micro-USD."""

    name = "amount"

    def __init__(self, *, signed: bool = False) -> None:
        self.signed = signed

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "USD|MICROS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return amount(str(value), signed=self.signed)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


AMOUNT = Amount()
SIGNED_AMOUNT = Amount(signed=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load_app(spec: str) -> Any:
    """The Celery app of ``-A``: ``module:attr``, else the module's ``app`` or ``celery``."""
    from celery import Celery

    module_name, _, attr = spec.partition(":")
    # As `celery -A` does: an app module in the current directory is found when the
    # console script runs (its sys.path starts at the script's directory instead).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # whatever the user's module raised, as one line
        raise CommandError(f"cannot import the Celery app {spec!r}: {_first_line(exc)}") from exc
    names = [attr] if attr else ["app", "celery"]
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, Celery):
            return found
    raise CommandError(
        f"module {module_name!r} has no Celery app named {' or '.join(names)} "
        f"(name it: -A {module_name}:NAME)"
    )


def _app_setting(ctx: click.Context, name: str) -> Any:
    """A setting of the ``-A`` app (None without ``-A`` or if unset)."""
    app = ctx.find_root().obj
    if app is not None and not hasattr(app, "conf"):
        app = getattr(app, "app", None)  # under `celery -A app budget`: Celery's CLIContext
    if app is None:
        return None
    try:
        return app.conf.get(name)
    except Exception as exc:  # its configuration module is imported on first read
        raise CommandError(f"cannot read the Celery app's settings: {_first_line(exc)}") from exc


def _ledger_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--ledger-url (after the command, else before it), else env, else the app's
    ``budget_ledger_url`` (None: none of them)."""
    if value is None:
        value = ctx.find_root().meta.get(_GROUP_LEDGER_URL)
    if value is None:
        value = os.environ.get(LEDGER_URL_ENV) or None
    if value is None:
        value = _app_setting(ctx, LEDGER_URL_SETTING) or None
    return None if value is None else str(value)


def _required_ledger_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    url = _ledger_url(ctx, param, value)
    if url is None:
        raise click.MissingParameter(
            ctx=ctx,
            param=param,
            message=f"Give it, set env {LEDGER_URL_ENV}, or name an app that sets "
            f"{LEDGER_URL_SETTING} with -A.",
        )
    return url


#: where the group's own --ledger-url (given before the command) is kept
_GROUP_LEDGER_URL = "budget_tasks.ledger_url"
_LEDGER_URL_HELP = (
    f"Ledger database URL (else env {LEDGER_URL_ENV}, else -A's {LEDGER_URL_SETTING})."
)

ledger_url_option = click.option(
    "--ledger-url", callback=_required_ledger_url, help=_LEDGER_URL_HELP
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
by_option = click.option(
    "--by",
    "by",
    default=None,
    help="Who acts, recorded in the journal (default: your OS user and host).",
)
note_option = click.option("--note", default=None, help="Why (recorded in the journal).")


def open_ledger(url: str) -> Any:
    """The ledger at ``url``; a SQLite file that is not there is an error, not created
    (only ``db upgrade`` makes one)."""
    from ..ledger import Ledger

    refuse_missing_sqlite(url)
    return Ledger(url)


def refuse_missing_sqlite(url: str) -> None:
    """A SQLite file that is not there is an error: only ``db upgrade`` makes one."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # ArgumentError, a port that is not a number: the ledger says so
        parsed = None
    if parsed is not None and parsed.get_backend_name() == "sqlite":
        path = parsed.database or ""
        named = path not in ("", ":memory:") and not path.startswith("file:")
        if named and not os.path.exists(path):
            raise CommandError(
                f"no ledger database at {path}: create it with "
                f"`budget-tasks db upgrade --ledger-url {url}`"
            )


def _frozen_by(budgets: Sequence[Any]) -> dict[str, str | None]:
    """For each budget, the budget whose freeze stops its admissions: itself, else its
    nearest frozen ancestor (a frozen parent admits nothing below it); None if none."""
    by_name = {b.name: b for b in budgets}
    out: dict[str, str | None] = {}
    for b in budgets:
        current, seen = b, set()
        while current is not None and current.name not in seen and not current.frozen:
            seen.add(current.name)
            current = by_name.get(current.parent) if current.parent else None
        out[b.name] = current.name if current is not None and current.frozen else None
    return out


def _frozen_text(name: str, frozen_by: str | None) -> str:
    if frozen_by is None:
        return "no"
    return "yes" if frozen_by == name else f"by {frozen_by}"


def _frozen_suffix(name: str, frozen_by: str | None) -> str:
    if frozen_by is None:
        return ""
    return " (frozen)" if frozen_by == name else f" (frozen by {frozen_by})"


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def _age(delta: timedelta | None) -> str:
    return age(None if delta is None else int(delta.total_seconds()))


def _safe(text: str) -> str:
    """``text`` with every character a terminal would act on (line breaks, escape
    sequences, bidirectional overrides) shown as its escape: a budget name or a key
    from the ledger never moves the cursor, clears the screen or fakes a row."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _safe_lines(text: str) -> str:
    """``text`` made safe line by line: the lines this CLI writes stay lines."""
    return "\n".join(_safe(line) for line in text.split("\n"))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [
        ["-" if c is None else _safe(str(c)) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: The longest --age a timedelta can hold, in seconds (about 31,000 years).
MAX_AGE_SECONDS = 10**12


def _duration(seconds: float) -> float:
    """A number of seconds that is a duration: finite, not negative, in range."""
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_AGE_SECONDS):
        raise click.BadParameter(f"{seconds} is not a duration in seconds (0 to {MAX_AGE_SECONDS})")
    return seconds


def _emit(as_json: bool, data: Any, render: Callable[[], str]) -> None:
    # JSON escapes every control character itself
    click.echo(json.dumps(_plain(data), indent=2) if as_json else _safe_lines(render()))


@click.group()
@click.version_option(package_name="budget-tasks")
@click.option(
    "-A",
    "--app",
    "app_spec",
    metavar="MODULE",
    default=None,
    help=f"Your Celery app (as celery -A: module or module:attr): its {LEDGER_URL_SETTING} "
    f"and {STALE_AFTER_SETTING} are the defaults.",
)
@click.option("--ledger-url", "group_ledger_url", default=None, help=_LEDGER_URL_HELP)
@click.pass_context
def main(ctx: click.Context, app_spec: str | None, group_ledger_url: str | None) -> None:
    """Spend-safe Celery tasks for LLM work: operate the budget ledger."""
    ctx.meta[_GROUP_LEDGER_URL] = group_ledger_url
    ctx.obj = _load_app(app_spec) if app_spec is not None else None


def _short(text: str | None, width: int = 60) -> str | None:
    if text is None:
        return None
    line = text.splitlines()[0] if text.strip() else text
    return line if len(line) <= width else line[: width - 3] + "..."
