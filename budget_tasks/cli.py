"""The ``budget-tasks`` command line."""

from __future__ import annotations

import logging
import sys

import click

from .errors import BudgetTasksError

LEDGER_URL_ENV = "BUDGET_TASKS_LEDGER_URL"

ledger_url_option = click.option(
    "--ledger-url",
    envvar=LEDGER_URL_ENV,
    required=True,
    help=f"Ledger database URL (env {LEDGER_URL_ENV}).",
)


@click.group()
@click.version_option(package_name="budget-tasks")
def main() -> None:
    """Spend-safe Celery tasks for LLM work: operate the budget ledger."""


@main.group()
def db() -> None:
    """Ledger schema migrations."""


@db.command("upgrade")
@ledger_url_option
@click.option("--revision", default="head", show_default=True)
def db_upgrade(ledger_url: str, revision: str) -> None:
    """Apply the ledger migrations."""
    from . import migrations

    migrations.upgrade(ledger_url, revision)
    click.echo(f"ledger schema at revision {migrations.current(ledger_url)}")


@main.command()
@click.option(
    "--ledger-url",
    envvar=LEDGER_URL_ENV,
    default=None,
    help="Run against this ledger instead of a temporary SQLite file.",
)
@click.option("--workers", default=8, show_default=True, type=click.IntRange(3, 64))
def demo(ledger_url: str | None, workers: int) -> None:
    """Walk through the ledger on embedded defaults; exit 1 if an invariant broke."""
    from . import demo as walkthrough

    _echo_logs("budget_tasks", prefix="   log: ")
    if not walkthrough.run(ledger_url, workers=workers, echo=click.echo):
        sys.exit(1)


def _echo_logs(logger: str, prefix: str) -> None:
    """Show the library's warnings in line with the command's own output."""

    class Echo(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            click.echo(prefix + self.format(record))

    logging.getLogger(logger).addHandler(Echo(logging.WARNING))


def run() -> None:
    """Entry point that turns library errors into one clear line and exit code 2."""
    try:
        main(standalone_mode=True)
    except BudgetTasksError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    run()
