"""A ledger filled by real work through the library, for the dashboard's tests: budgets
with a tenant under its parent, settled calls (one above its estimate), unknown
outcomes (Anthropic Messages, which reconciliation cannot settle, and a stored OpenAI
chat, which it can), a hold never sent, and operations that succeeded and failed."""

from __future__ import annotations

from typing import Any

import pytest

from budget_tasks import Ledger
from budget_tasks.testing import ManualClock


def _sent(
    ledger: Ledger,
    budget: str,
    key: str,
    amount: int,
    *,
    provider: str,
    model: str,
    request_id: str,
    lookup: str,
) -> None:
    """A call admitted, described and sent, as the guarded transport does it."""
    calls = ledger.calls
    calls.reserve(budget, key, amount)
    calls.describe_attempt(key, lookup=lookup, model=model, timeout=30.0)
    calls.mark_sending(key, provider=provider, request_id=request_id)


def fill(ledger: Ledger, clock: ManualClock) -> None:
    from budget_tasks.delivery.flow import Delivery, OperationManager
    from budget_tasks.delivery.options import DeliveryOptions

    calls = ledger.calls
    ledger.create_budget("acme", 1_000_000, period="month")
    ledger.create_budget("acme-support", 400_000, period="day", parent="acme", tenant="support")
    ledger.create_budget("research", 200_000)

    # at 12:00 on 2026-01-01: a call settled below its estimate
    _sent(
        ledger,
        "acme-support",
        "call-1",
        50_000,
        provider="openai",
        model="gpt-4o-mini",
        request_id="req_1",
        lookup="openai.chat",
    )
    calls.settle("call-1", 30_000)
    clock.advance(minutes=30)
    # one above it: an overrun of 6000
    _sent(
        ledger,
        "acme-support",
        "call-2",
        20_000,
        provider="openai",
        model="gpt-4o-mini",
        request_id="req_2",
        lookup="openai.chat",
    )
    calls.settle("call-2", 26_000)
    clock.advance(minutes=30)
    # Anthropic Messages timed out: only a person can settle them
    _sent(
        ledger,
        "acme-support",
        "claude-1",
        40_000,
        provider="anthropic",
        model="claude-haiku-4-5",
        request_id="req_ant_1",
        lookup="anthropic.messages",
    )
    calls.mark_unknown("claude-1", "read timeout")
    _sent(
        ledger,
        "research",
        "claude-2",
        15_000,
        provider="anthropic",
        model="claude-haiku-4-5",
        request_id="req_ant_2",
        lookup="anthropic.messages",
    )
    calls.mark_unknown("claude-2", "connection reset after send")
    # a stored OpenAI chat timed out: beat looks it up
    _sent(
        ledger,
        "research",
        "gpt-1",
        10_000,
        provider="openai",
        model="gpt-4o-mini",
        request_id="req_oai_9",
        lookup="openai.chat",
    )
    calls.mark_unknown("gpt-1", "read timeout")
    # a hold never sent
    calls.reserve("research", "gpt-2", 5_000)
    clock.advance(minutes=5)

    manager = OperationManager(ledger.calls, DeliveryOptions(task="jobs.summarize"))

    def deliver(key: str, run: Any) -> Any:
        return manager.deliver(
            Delivery(key=key, fingerprint="f", budget="research", estimate=lambda: 900, run=run)
        )

    def summary(scope: Any) -> str:
        scope.record_usage(700)
        return "summary"

    def broken(scope: Any) -> str:
        scope.record_usage(300)  # billed, then the user's bug
        raise ValueError("the user's bug")

    assert deliver("doc-1", summary) == "summary"
    with pytest.raises(ValueError, match="the user's bug"):
        deliver("doc-2", broken)
    clock.advance(minutes=5)


def journal_rows(ledger: Ledger) -> int:
    from sqlalchemy import text

    with ledger.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM journal")).scalar_one())
