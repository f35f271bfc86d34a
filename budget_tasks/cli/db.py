"""Ledger schema migrations."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from . import _common
from ._common import (
    CommandError,
    _first_line,
    ledger_url_option,
    main,
)


@main.group()
def db() -> None:
    """Ledger schema migrations."""


@contextmanager
def _reaching_the_database() -> Iterator[None]:
    """No server, no such database: one line, as every command says it."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        raise CommandError(
            f"cannot reach the ledger database: {_first_line(exc.orig or exc)}"
        ) from exc


@db.command("upgrade")
@ledger_url_option
@click.option("--revision", default="head", show_default=True)
def db_upgrade(ledger_url: str, revision: str) -> None:
    """Apply the ledger migrations."""
    from alembic.util import CommandError as AlembicError

    from .. import migrations

    try:
        with _reaching_the_database():
            migrations.upgrade(ledger_url, revision)
            at = migrations.current(ledger_url)
    except AlembicError as exc:  # e.g. an unknown --revision
        raise CommandError(_first_line(exc)) from exc
    click.echo(f"ledger schema at revision {at}")


def _revisions(ledger_url: str) -> tuple[str | None, str]:
    """The revision the ledger is at (None: never migrated), and this release's head.
    A SQLite file that is not there is an error, not made."""
    from .. import migrations

    _common.refuse_missing_sqlite(ledger_url)
    with _reaching_the_database():
        return migrations.current(ledger_url), migrations.head()


@db.command("current")
@ledger_url_option
def db_current(ledger_url: str) -> None:
    """The ledger's schema revision, and this release's."""
    at, head = _revisions(ledger_url)
    if at is None:
        click.echo(
            f"ledger schema not migrated (this release: {head}): run budget-tasks db upgrade"
        )
    elif at == head:
        click.echo(f"ledger schema at revision {at} (head)")
    else:
        click.echo(f"ledger schema at revision {at}; this release's head is {head}")


@db.command("check")
@ledger_url_option
def db_check(ledger_url: str) -> None:
    """Exit 0 if the ledger's schema is at this release's head, else 1 (for a deploy
    step: run `budget-tasks db upgrade` first)."""
    at, head = _revisions(ledger_url)
    if at == head:
        click.echo(f"ledger schema at head ({head})")
        return
    click.echo(
        f"ledger schema at {at or 'no revision'}, not this release's head {head}: "
        "run budget-tasks db upgrade",
        err=True,
    )
    sys.exit(1)
