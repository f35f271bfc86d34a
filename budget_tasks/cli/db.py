"""Ledger schema migrations."""

from __future__ import annotations

import click

from ._common import (
    CommandError,
    _first_line,
    ledger_url_option,
    main,
)


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

    from .. import migrations

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
