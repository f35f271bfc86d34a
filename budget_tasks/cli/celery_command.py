"""``celery -A app budget ...``: the same commands as ``budget-tasks``, as a Celery
sub-command (registered through Celery's ``celery.commands`` entry points, as Flower
adds ``celery flower``). The app comes from Celery's own ``-A``."""

from __future__ import annotations

from typing import Any

import click

from ..errors import BudgetTasksError

# each verb module registers its commands on the root group
from . import budgets, db, money, offline, operations, providers, retention, status  # noqa: F401
from ._common import _GROUP_LEDGER_URL, _LEDGER_URL_HELP, CommandError, main


class _Budget(click.Group):
    """The library's errors as one ``error:`` line and exit 2, as ``budget-tasks`` does."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (BudgetTasksError, ValueError, TypeError) as exc:
            raise CommandError(str(exc)) from exc


@click.group(cls=_Budget, name="budget", commands=main.commands)
@click.option("--ledger-url", "group_ledger_url", default=None, help=_LEDGER_URL_HELP)
@click.pass_context
def budget(ctx: click.Context, group_ledger_url: str | None) -> None:
    """Operate the budget ledger (budget-tasks' commands; the ledger URL defaults to
    the app's budget_ledger_url)."""
    ctx.meta[_GROUP_LEDGER_URL] = group_ledger_url
