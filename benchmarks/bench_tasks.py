"""The two tasks task_overhead.py compares: the same provider call, plain and budgeted."""

from __future__ import annotations

from typing import Any

from budget_tasks import BudgetTask
from budget_tasks.providers import openai_chat
from workers import app
from workers.tasks import client

REQUEST: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "ping"}],
}


@app.task(name="bench.plain")
def plain(n: int) -> int:
    sent = openai_chat(client(), key=f"plain:{n}", store_for_lookup=False, **REQUEST)
    return sent.cost or 0


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.budgeted",
    budget="bench",
    idempotency_key=lambda n: f"budgeted:{n}",
    estimate_cost=lambda n: 1_000,
)
def budgeted(self: BudgetTask, n: int) -> int:
    sent = openai_chat(
        client(),
        key=self.attempt.key,
        store_for_lookup=False,
        on_request_id=self.attempt.record_request_id,
        **REQUEST,
    )
    self.attempt.record(sent)
    return sent.cost or 0
