"""The tasks the benchmarks run in a real worker (``-I benchmarks.bench_tasks``).

``bench.plain`` and ``bench.budgeted`` make the same provider call, plain and budgeted
(overhead and replay figures); with ``delay=S`` the fake provider takes S seconds to
answer that call (the ``x-fake-fault: delay=S`` header on the request itself, so each
call of either kind gets exactly that delay). ``bench.cheap`` is a BudgetTask with no
provider call: it reserves a tiny estimate, records a usage and settles (four ledger
transactions), so 10,000 of them fit in the memory figure's time.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from budget_tasks import BudgetTask
from budget_tasks.providers import openai_chat, openai_client
from workers.app import app


@cache
def client() -> Any:
    """The plain SDK client (retries off) both kinds of task call through."""
    return openai_client(base_url=os.environ.get("OPENAI_BASE_URL"), api_key="sk-bench")


REQUEST: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "ping"}],
}


def _request(delay: float) -> dict[str, Any]:
    if not delay:
        return REQUEST
    return {**REQUEST, "extra_headers": {"x-fake-fault": f"delay={delay:g}"}}


@app.task(name="bench.plain")
def plain(n: str, delay: float = 0.0) -> int:
    sent = openai_chat(client(), key=f"plain:{n}", store_for_lookup=False, **_request(delay))
    return sent.cost or 0


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.budgeted",
    budget="bench",
    idempotency_key=lambda n, delay=0.0: f"budgeted:{n}",
    estimate_cost=lambda n, delay=0.0: 1_000,
)
def budgeted(self: BudgetTask, n: str, delay: float = 0.0) -> int:
    sent = openai_chat(
        client(),
        key=self.attempt.key,
        store_for_lookup=False,
        on_request_id=self.attempt.record_request_id,
        **_request(delay),
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
