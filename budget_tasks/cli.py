"""The ``budget-tasks`` command line: migrations, budgets, holds, resolution, audit."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import IO, Any

import click

from ._display import age
from .config import LEDGER_URL_ENV, LEDGER_URL_SETTING
from .errors import BudgetTasksError

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


def _ledger(url: str) -> Any:
    """The ledger at ``url``; a SQLite file that is not there is an error, not created
    (only ``db upgrade`` makes one)."""
    from sqlalchemy.engine import make_url

    from .ledger import Ledger

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
    return Ledger(url)


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


# -- db ------------------------------------------------------------------------------


@main.group()
def db() -> None:
    """Ledger schema migrations."""


@db.command("upgrade")
@ledger_url_option
@click.option("--revision", default="head", show_default=True)
def db_upgrade(ledger_url: str, revision: str) -> None:
    """Apply the ledger migrations."""
    from alembic.util import CommandError as AlembicError
    from sqlalchemy.exc import InterfaceError, OperationalError

    from . import migrations

    try:
        migrations.upgrade(ledger_url, revision)
        at = migrations.current(ledger_url)
    except (OperationalError, InterfaceError) as exc:  # no server, no such database
        raise CommandError(
            f"cannot reach the ledger database: {_first_line(exc.orig or exc)}"
        ) from exc
    except AlembicError as exc:  # e.g. an unknown --revision
        raise CommandError(_first_line(exc)) from exc
    click.echo(f"ledger schema at revision {at}")


# -- budgets -------------------------------------------------------------------------


@main.group()
def budget() -> None:
    """Create, list, show, freeze and unfreeze budgets, and set their caps."""


@budget.command("create")
@ledger_url_option
@click.argument("name")
@click.option("--cap", type=int, required=True, help="Minor units (micro-USD) per period.")
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
    type=int,
    default=None,
    help="The most a rolled-over period may open with (minor units); default: no ceiling.",
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
    info = _ledger(ledger_url).create_budget(
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
    _emit(as_json, info, lambda: f"created budget {info.name}: cap {info.cap}{per}")


@budget.command("list")
@ledger_url_option
@json_option
def budget_list(ledger_url: str, as_json: bool) -> None:
    """All budgets and their configuration (frozen: yes, or by the ancestor whose
    freeze stops it)."""
    budgets = _ledger(ledger_url).budgets()
    frozen_by = _frozen_by(budgets)
    _emit(
        as_json,
        [{**_plain(b), "frozen_by": frozen_by[b.name]} for b in budgets],
        lambda: _table(
            ["budget", "cap", "period", "renewal", "parent", "tenant", "frozen"],
            [
                [
                    b.name,
                    b.cap,
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
    ledger = _ledger(ledger_url)
    info, bal, holds = ledger.budget(name), ledger.balance(name), ledger.holds(budget=name)
    frozen_by = _frozen_by(ledger.budgets())[name]
    data = {"budget": {**_plain(info), "frozen_by": frozen_by}, "balance": bal, "holds": holds}
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
                + f": cap {bal.cap}, spent {bal.spent}, held {bal.held}, "
                + (f"unused grants below {bal.granted}, " if bal.granted else "")
                + (f"drawn {bal.drawn}, " if info.escrow else "")
                + f"available {bal.available}",
                f"open holds: {len(holds)}",
            ]
        ),
    )


def _set_frozen(
    ledger_url: str, name: str, frozen: bool, note: str | None, by: str | None, as_json: bool
) -> None:
    ledger = _ledger(ledger_url)
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
@click.option("--cap", type=int, required=True, help="The new cap per period (minor units).")
@note_option
@by_option
@json_option
def budget_set_cap(
    ledger_url: str, name: str, cap: int, note: str | None, by: str | None, as_json: bool
) -> None:
    """Raise or lower a budget's cap; never below what its period has spent and holds."""
    ledger = _ledger(ledger_url)
    before = ledger.budget(name).cap
    info = ledger.set_cap(name, cap, note=note, actor=by)
    _emit(as_json, info, lambda: f"budget {name}: cap {before} -> {info.cap}")


@budget.command("set-slices")
@ledger_url_option
@click.argument("name")
@click.argument("slices", type=int)
@json_option
def budget_set_slices(ledger_url: str, name: str, slices: int, as_json: bool) -> None:
    """Split a budget's money over SLICES rows that share its cap (1: one row)."""
    info = _ledger(ledger_url).set_slices(name, slices)
    _emit(as_json, info, lambda: f"budget {name}: {info.slices} slices")


@main.command()
@ledger_url_option
@click.argument("attempt")
@click.option("--delta", type=int, required=True, help="Minor units, + charges more, - refunds.")
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
    ledger = _ledger(ledger_url)
    applied = ledger.adjust(attempt, delta, reason, ref=ref, actor=by)
    after = ledger.attempt(attempt)
    _emit(
        as_json,
        {**_plain(after), "applied": applied},
        lambda: (
            f"{attempt}: {'adjusted by' if applied else 'already adjusted (ref seen):'} "
            f"{delta:+d} ({reason})"
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
@json_option
def holds(ledger_url: str, stale: bool, age: float, budget_name: str | None, as_json: bool) -> None:
    """Money still held, oldest first, with its age."""
    ledger = _ledger(ledger_url)
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
                    h.amount,
                    _age(h.age),
                    h.request_id,
                    "yes" if h.flagged_at else "no",
                ]
                for h in found
            ],
        ),
    )


# -- operations ----------------------------------------------------------------------


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
    """Operations, the most recently changed first."""
    found = _ledger(ledger_url).operations(status=status, limit=limit)
    _emit(
        as_json,
        found,
        lambda: _table(
            ["operation", "status", "task", "runs", "deliveries", "replays", "error"],
            [
                [o.key, o.status, o.task, o.runs, o.deliveries, o.replays, _short(o.error)]
                for o in found
            ],
        ),
    )


def _short(text: str | None, width: int = 60) -> str | None:
    if text is None:
        return None
    line = text.splitlines()[0] if text.strip() else text
    return line if len(line) <= width else line[: width - 3] + "..."


@operations.command("show")
@ledger_url_option
@click.argument("key")
@json_option
def operations_show(ledger_url: str, key: str, as_json: bool) -> None:
    """One operation: its status and stored result, its attempts with their holds, the
    journal entries they wrote, and what operators did to it."""
    history = _ledger(ledger_url).operation_history(key)
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
                    [a.key, a.state, a.reason, a.amount, a.actual, a.request_id]
                    for a in history.attempts
                ],
            )
        )
        lines += ["", "journal:"]
        lines.append(
            _table(
                ["attempt", "budget", "kind", "held", "spent", "note"],
                [
                    [e.attempt, e.budget, e.kind, e.held_delta, e.spent_delta, _short(e.note)]
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
    op = _ledger(ledger_url).reopen_operation(key, reason=reason, by=by)
    _emit(
        as_json,
        op,
        lambda: f"operation {key}: failed -> {op.status}; enqueue it again to run it",
    )


@main.command()
@ledger_url_option
@click.argument("attempt")
@click.option(
    "--actual",
    type=int,
    required=True,
    help="What the provider charged, in minor units (0: it charged nothing).",
)
@click.option("--note", required=True, help="Why: recorded in the journal.")
@by_option
@json_option
def resolve(
    ledger_url: str, attempt: str, actual: int, note: str, by: str | None, as_json: bool
) -> None:
    """An operator's settlement (or, with --actual 0, release) of a held attempt."""
    from .resolution import NeverSent, resolve_outcome

    # Compare-and-set on the state shown to the operator: if it moved since, nothing
    # changes and the command says so (the dashboard resolves by the same function).
    try:
        resolution = resolve_outcome(_ledger(ledger_url), attempt, actual, note, by)
    except NeverSent as exc:
        raise click.UsageError(str(exc)) from exc
    before, done, after = resolution.before, resolution.done, resolution.after

    def text() -> str:
        line = f"{attempt}: {before.state} -> {after.state}, charged {after.actual}"
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
    done = _ledger(ledger_url).actions(budget=budget_name, limit=limit)
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
                    e.spent_delta,
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
    ledger = _ledger(ledger_url)
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
                    [f.budget, f.period_start.date(), f.counter, f.recorded, f.journal]
                    for f in findings
                ],
            )
        ),
    )
    if findings:
        sys.exit(1)


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
    ledger = _ledger(ledger_url)
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
    ledger = _ledger(ledger_url)
    done = ledger.upkeep.retain(timedelta(days=keep_days), archive_to=archive_to)

    def render() -> str:
        lines = [f"archived {name} to {archive_to}" for name in done.archived]
        lines += [f"kept {name}: {'; '.join(why)}" for name, why in done.blocked.items()]
        lines.append(f"removed {done.attempts:,} attempts and {done.operations:,} operations")
        return "\n".join(lines)

    _emit(as_json, done, render)
    if done.blocked:
        sys.exit(1)


@main.command()
@click.option("--vendor", "vendor_name", default=None, help="Only this vendor's rules.")
@json_option
def providers(vendor_name: str | None, as_json: bool) -> None:
    """What each vendor's POSTs are: metered, free or refused, and why (the rules the
    guarded transport judges a request by; anything they do not name is refused)."""
    from .providers import registry

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
    from .pricing import PriceContext, default_prices

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


@main.command()
@ledger_url_option
@json_option
def status(ledger_url: str, as_json: bool) -> None:
    """Every budget's current period: cap, spent and held (the budgets below it
    included), granted (held unused by escrowed budgets below), available, oldest hold."""
    ledger = _ledger(ledger_url)
    frozen_by = _frozen_by(ledger.budgets())
    rows = [
        {
            "budget": r.budget,
            "cap": r.cap,
            "spent": r.spent,
            "held": r.held,
            "available": r.available,
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
            ["budget", "cap", "spent", "held", "granted", "available", "oldest hold"],
            [
                [
                    r["budget"] + _frozen_suffix(r["budget"], r["frozen_by"]),
                    r["cap"],
                    r["spent"],
                    r["held"],
                    r["granted"],
                    r["available"],
                    _age(r["oldest_hold"]),
                ]
                for r in rows
            ],
        ),
    )


# -- the dashboard -------------------------------------------------------------------


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

        from .dashboard.app import TOKEN_ENV, create_app, token_from_env
    except ImportError as exc:
        raise CommandError(
            f"the dashboard needs its extra: pip install 'budget-tasks[dashboard]' ({exc.name})"
        ) from exc
    token = token_from_env()
    app = create_app(_ledger(ledger_url), token=token, hosts=(*allow_hosts, host))
    mode = "resolving and reopening with the token" if token else f"read-only (no {TOKEN_ENV})"
    click.echo(f"dashboard on http://{host}:{port}/ ({mode}); Ctrl-C stops it", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


# -- the fake provider ---------------------------------------------------------------


@main.command("fake-provider")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8089, show_default=True, type=click.IntRange(0, 65535))
@click.option("--kind", is_flag=True, help="Turn off every realistic behaviour (compression, ...).")
def fake_provider(host: str, port: int, kind: bool) -> None:
    """Serve the fake OpenAI/Anthropic provider until Ctrl-C: run the Quick start and
    your own tasks offline, with no key and nothing billed."""
    import contextlib

    from .testing.fake_provider import FakeProvider, Realism

    fake = FakeProvider(host, port, realism=Realism.kind() if kind else None)
    click.echo(f"fake provider on {fake.url}; point the SDKs at it with:")
    click.echo(f"  export OPENAI_BASE_URL={fake.openai_base_url} OPENAI_API_KEY=sk-fake")
    click.echo(f"  export ANTHROPIC_BASE_URL={fake.url} ANTHROPIC_API_KEY=sk-ant-fake")
    with contextlib.suppress(KeyboardInterrupt):
        fake.serve_forever()


# -- demo ------------------------------------------------------------------------------


@main.command()
@click.option(
    "--ledger-url",
    envvar=LEDGER_URL_ENV,
    default=None,
    callback=_ledger_url,
    help="Run against this ledger (e.g. PostgreSQL) instead of a temporary SQLite file.",
)
@click.option(
    "--broker-url",
    envvar="CELERY_BROKER_URL",
    default=None,
    help="Run through this broker (e.g. redis://...) instead of a temporary SQLite one.",
)
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(2, 16))
def demo(ledger_url: str | None, broker_url: str | None, concurrency: int) -> None:
    """Run Celery workers against two tenants' budgets, kill one mid-call, time one
    out, reconcile both; exit 1 if an invariant broke."""
    from .demo.scenario import run as run_scenario

    if not run_scenario(ledger_url, broker_url, concurrency=concurrency, echo=click.echo):
        sys.exit(1)


@main.command()
@click.option(
    "--ledger-url",
    envvar=LEDGER_URL_ENV,
    default=None,
    callback=_ledger_url,
    help="Run against this ledger instead of a temporary SQLite file.",
)
@click.option("--workers", default=8, show_default=True, type=click.IntRange(3, 64))
def walkthrough(ledger_url: str | None, workers: int) -> None:
    """Walk through the ledger alone (processes racing, replay, overrun, correction);
    exit 1 if an invariant broke."""
    from .demo.walkthrough import run as run_walkthrough

    _echo_logs("budget_tasks", prefix="   log: ")
    if not run_walkthrough(ledger_url, workers=workers, echo=click.echo):
        sys.exit(1)


def _echo_logs(logger: str, prefix: str) -> None:
    """Show the library's warnings in line with the command's own output."""

    class Echo(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            click.echo(prefix + self.format(record))

    logging.getLogger(logger).addHandler(Echo(logging.WARNING))


def run() -> None:
    """Entry point that turns bad input into one clear line and exit code 2."""
    try:
        code = main(standalone_mode=False)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "budget-tasks"
        message = (exc.format_message().strip().splitlines() or ["bad usage"])[0]
        click.echo(f"error: {_safe(message)} (see {_safe(where)} --help)", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except (BudgetTasksError, ValueError, TypeError) as exc:
        click.echo(f"error: {_safe(str(exc))}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    run()
