"""An answer's rate-limit headers are read at the ledger's clock, not this host's: the
ledger keeps time by its database, and a window narrowed to what the provider said
remains must count the refill since then on that same clock. Here the ledger's clock
runs two hours ahead of this host's (eager mode, the official SDK through the guarded
transport to the fake provider, a real ledger)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from celery import Celery

from budget_tasks import BudgetTask
from budget_tasks.config import close_ledgers, ledger_of
from budget_tasks.testing import FakeProvider
from budget_tasks.testing.clock import ManualClock
from budget_tasks.transport import guarded_openai_client


def test_an_answers_rate_headers_narrow_the_window_by_the_ledgers_clock(
    backend_url: str, fake: FakeProvider
) -> None:
    app = Celery("clock-apart", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    client = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"clock{uuid.uuid4().hex[:6]}.ask",
        budget="team",
        estimate_cost=lambda: 0,
    )
    def ask(self: BudgetTask) -> int:
        answer = client.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=8,
            messages=[{"role": "user", "content": "what time is it"}],
        )
        return int(answer.usage.total_tokens)

    ledger = ledger_of(app)
    ledger.create_budget("team", 1_000_000)
    # the ledger's time: two hours past this host's
    ledger._store.clock = ManualClock(datetime.now(UTC) + timedelta(hours=2))
    fake.set_limits("openai", "gpt-4o-mini", requests=10)
    ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", 60)
    try:
        ask.delay().get()
        [window] = ledger.rates.windows()
        # the answer said 10 a minute, 9 left: read as of the ledger's time, nothing has
        # refilled since (read at this host's, the two hours between would fill it)
        assert window.per_minute == 10
        assert window.available == 9
    finally:
        close_ledgers()
