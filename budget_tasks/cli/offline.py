"""Offline: the fake provider, the demo and the walkthrough."""

from __future__ import annotations

import logging
import sys

import click

from ..config import LEDGER_URL_ENV
from ._common import (
    CommandError,
    _ledger_url,
    main,
)


@main.command("fake-provider")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8089, show_default=True, type=click.IntRange(0, 65535))
@click.option("--kind", is_flag=True, help="Turn off every realistic behaviour (compression, ...).")
@click.option(
    "--limit",
    "limits",
    multiple=True,
    metavar="VENDOR:MODEL:KIND=N[,KIND=N...]",
    help="Rate-limit a model (or * for every model of the vendor), a minute, as the vendor "
    "would: e.g. openai:gpt-4o-mini:requests=600,tokens=60000. Kinds: requests, tokens "
    "(and Anthropic's input_tokens, output_tokens). Repeatable.",
)
def fake_provider(host: str, port: int, kind: bool, limits: tuple[str, ...]) -> None:
    """Serve the fake OpenAI/Anthropic provider until Ctrl-C: run the Quick start and
    your own tasks offline, with no key and nothing billed."""
    import contextlib

    from ..pricing import default_prices
    from ..testing.fake_billing import Realism
    from ..testing.fake_limits import describe, parse_limits
    from ..testing.fake_provider import FakeProvider

    try:  # every --limit is checked before the port is taken
        specs = parse_limits(limits, default_prices())
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--limit'") from None
    fake = FakeProvider(host, port, realism=Realism.kind() if kind else None)
    for spec in specs:
        fake.set_limits(spec.vendor, spec.model, **spec.limits)
    click.echo(f"fake provider on {fake.url}; point the SDKs at it with:")
    click.echo(f"  export OPENAI_BASE_URL={fake.openai_base_url} OPENAI_API_KEY=sk-fake")
    click.echo(f"  export ANTHROPIC_BASE_URL={fake.url} ANTHROPIC_API_KEY=sk-ant-fake")
    for spec in specs:
        click.echo(f"rate limit {describe(spec)}")
    with contextlib.suppress(KeyboardInterrupt):
        fake.serve_forever()


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
    try:
        import openai  # noqa: F401  - the demo's workers call through it
    except ImportError:
        raise CommandError(
            "the demo's workers call the fake provider through the official openai SDK, "
            "which is not installed here: pip install 'budget-tasks[openai]'"
        ) from None
    from ..demo.scenario import run as run_scenario

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
    from ..demo.walkthrough import run as run_walkthrough

    _echo_logs("budget_tasks", prefix="   log: ")
    if not run_walkthrough(ledger_url, workers=workers, echo=click.echo):
        sys.exit(1)


def _echo_logs(logger: str, prefix: str) -> None:
    """Show the library's warnings in line with the command's own output."""

    class Echo(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            click.echo(prefix + self.format(record))

    logging.getLogger(logger).addHandler(Echo(logging.WARNING))
