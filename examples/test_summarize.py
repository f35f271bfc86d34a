"""Testing your own BudgetTask with the pytest plugin budget-tasks installs.

Run it: ``pytest examples/test_summarize.py`` (SQLite), or against PostgreSQL:
``pytest examples/test_summarize.py --budget-ledger-url postgresql://postgres@127.0.0.1/postgres``
(each test gets a new database on that server, dropped after it).
"""

from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetExceeded, BudgetTask, Ledger
from budget_tasks.testing import FakeProvider
from budget_tasks.transport import guarded_openai_client

app = Celery("example")
client = guarded_openai_client(timeout=60)  # fake_llm points it at the fake provider


@app.task(
    base=BudgetTask,
    bind=True,
    budget="acme",
    idempotency_key=lambda doc_id, text: f"summarize:{doc_id}",
    estimate_cost=lambda doc_id, text: 0,  # the SDK call reserves its own bound
)
def summarize(self: BudgetTask, doc_id: str, text: str) -> str:
    completion = client.chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=64,
        messages=[{"role": "user", "content": f"Summarise: {text}"}],
    )
    return str(completion.choices[0].message.content)


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
