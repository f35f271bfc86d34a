"""The ``budget-tasks`` command line, one module per verb group: migrations (``db``),
budgets, the money's record (holds, corrections, resolutions, actions, the audit),
operations, retention, what is known of the providers, drift against their reports,
the providers' rate limits, status and the dashboard,
and the offline tools (the fake provider, the demo, the walkthrough)."""

from __future__ import annotations

import sys

import click

from ..errors import BudgetTasksError

# each verb module registers its commands on the root group
from . import (  # noqa: F401
    budgets,
    db,
    drift,
    limits,
    money,
    offline,
    operations,
    providers,
    retention,
    status,
)
from ._common import _safe, main

__all__ = ["main", "run"]


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
