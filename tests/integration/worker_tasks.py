"""Extra tasks that the test workers load (``celery worker -I``) beside workers.tasks."""

from __future__ import annotations

import os
import signal
from typing import Any

from budget_tasks import BudgetTask
from budget_tasks.providers import estimates, openai_chat
from workers import app
from workers.tasks import BUDGET, client


def fixed_request(n: int) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "max_completion_tokens": 32,
        "messages": [{"role": "user", "content": "Classify ticket 0000."}],
    }


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.fixed_cost",
    idempotency_key=lambda n: f"fixed:{n}",
    estimate_cost=lambda n: estimates.openai_chat(fixed_request(n)).amount,
)
def fixed_cost(self: BudgetTask, n: int) -> int:
    """Calls the provider and reports no usage: charged exactly its reservation, so the
    number of admissions under a cap is exact."""
    openai_chat(client(), key=self.attempt.key, **fixed_request(n))
    return n


def _die(n: int) -> int:
    os.kill(os.getpid(), signal.SIGKILL)  # a segfault, an OOM kill: the child is gone
    return 0


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.crasher",
    max_deliveries=3,
    idempotency_key=lambda n: f"crash:{n}",
    estimate_cost=_die,
)
def crasher(self: BudgetTask, n: int) -> int:
    return n
