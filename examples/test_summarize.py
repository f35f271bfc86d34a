"""Testing your own BudgetTask with the pytest plugin budget-tasks installs.

Run it: ``pytest examples/test_summarize.py`` (SQLite), or against PostgreSQL:
``pytest examples/test_summarize.py --budget-ledger-url postgresql://postgres@127.0.0.1/postgres``
(each test gets a new database on that server, dropped after it).
"""

from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetExceeded, BudgetTask, Ledger
from budget_tasks.providers import estimates, openai_chat, openai_client
from budget_tasks.testing import FakeProvider

app = Celery("example")


def request(text: str) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "max_completion_tokens": 64,
        "messages": [{"role": "user", "content": f"Summarise: {text}"}],
    }


@app.task(
    base=BudgetTask,
    bind=True,
    budget="acme",
    idempotency_key=lambda doc_id, text: f"summarize:{doc_id}",
    estimate_cost=lambda doc_id, text: estimates.openai_chat(request(text)).amount,
)
def summarize(self: BudgetTask, doc_id: str, text: str) -> str:
    sent = openai_chat(openai_client(), attempt=self.attempt, **request(text))
    return str(sent.result["content"])


@pytest.mark.budgets(acme=1_000_000)
def test_a_duplicate_replays_and_spend_is_what_was_billed(
    budget_ledger: Ledger, fake_llm: FakeProvider, budget_eager: Any
) -> None:
    budget_eager(app)
    first = summarize.delay("doc-1", "The board met and approved the budget.").get()
    again = summarize.delay("doc-1", "The board met and approved the budget.").get()
    assert again == first
    assert len([s for s in fake_llm.served() if s.method == "POST"]) == 1
    assert budget_ledger.balance("acme").spent == fake_llm.state()["billed_total"] > 0


@pytest.mark.budgets(acme=10)
def test_a_budget_too_small_is_denied_before_any_request(
    budget_ledger: Ledger, fake_llm: FakeProvider, budget_eager: Any
) -> None:
    budget_eager(app)
    with pytest.raises(BudgetExceeded):
        summarize.delay("doc-2", "Too long for ten micro-dollars.").get()
    assert fake_llm.served() == []
    assert budget_ledger.balance("acme").held == 0
