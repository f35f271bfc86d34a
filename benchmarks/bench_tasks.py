"""The tasks the benchmarks run in a real worker (``-I benchmarks.bench_tasks``).

``bench.plain`` and ``bench.budgeted`` make the same provider call, plain and budgeted
(overhead and replay figures). ``bench.cheap`` is a BudgetTask with no provider call:
it reserves a tiny estimate, records a usage and settles (four ledger transactions), so
10,000 of them fit in the memory figure's time.
"""

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
def plain(n: str) -> int:
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
def budgeted(self: BudgetTask, n: str) -> int:
    sent = openai_chat(
        client(),
        key=self.attempt.key,
        store_for_lookup=False,
        on_request_id=self.attempt.record_request_id,
        **REQUEST,
    )
    self.attempt.record(sent)
    return sent.cost or 0


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.cheap",
    budget="bench",
    idempotency_key=lambda n: f"cheap:{n}",
    estimate_cost=lambda n: 10,
)
def cheap(self: BudgetTask, n: str) -> int:
    self.attempt.record_usage(7)
    return 7
