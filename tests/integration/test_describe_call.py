"""``describe_call``: what the main call is, written with the admission that grants its
send, so that reconciliation can find the call should the run die mid-call, and the
``attempt=`` helpers write nothing more before sending (eager, SQLite and PostgreSQL,
the official SDK against the fake provider)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetTask, CallFacts, Ledger
from budget_tasks.config import close_ledgers
from budget_tasks.ledger import CallLedger
from budget_tasks.providers import estimates
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider
from tests.support.sdk_calls import LOOKUP_OPENAI_CHAT, openai_chat

MODEL = "gpt-4o-mini"


def request(text: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_completion_tokens": 32,
        "messages": [{"role": "user", "content": text}],
    }


@pytest.fixture
def app(backend_url: str, fake: FakeProvider) -> Any:
    close_ledgers()
    prefix = f"describe{uuid.uuid4().hex[:8]}"
    app = Celery("describe-call", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=2.5)
    ledger = Ledger(backend_url)
    ledger.create_budget("team", 10_000_000)
    ledger.dispose()
    seen: dict[str, Any] = {}

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.described",
        budget="team",
        idempotency_key=lambda doc: f"described:{doc}",
        estimate_cost=lambda doc: estimates.openai_chat(request(doc)).amount,
        describe_call=lambda doc: CallFacts(LOOKUP_OPENAI_CHAT, MODEL, 2.5),
    )
    def described(self: BudgetTask, doc: str) -> str:
        # what the ledger holds of the call before anything is sent
        seen["before"] = Ledger(backend_url).attempt(self.attempt.attempt_key)
        sent = openai_chat(client, attempt=self.attempt, **request(doc))
        return str(sent.result["content"])

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.misdescribed",
        budget="team",
        idempotency_key=lambda doc: f"misdescribed:{doc}",
        estimate_cost=lambda doc: 1_000,
        describe_call=lambda doc: {"lookup": LOOKUP_OPENAI_CHAT, "model": MODEL},
    )
    def misdescribed(self: BudgetTask, doc: str) -> str:
        return str(openai_chat(client, attempt=self.attempt, **request(doc)).result["content"])

    app.jobs = {"described": described, "misdescribed": misdescribed}
    app.seen = seen
    app.url = backend_url
    yield app
    close_ledgers()


def test_the_call_is_described_with_its_admission_and_the_helper_writes_nothing_more(
    app: Any, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_write(*_: Any, **__: Any) -> None:
        raise AssertionError("the call was described at admission: no write expected")

    monkeypatch.setattr(CallLedger, "describe_attempt", no_write)
    assert app.jobs["described"].delay("q3").get()
    before = app.seen["before"]
    assert (before.state, before.lookup, before.model) == ("sending", LOOKUP_OPENAI_CHAT, MODEL)
    assert before.timeout_ms == 2_500 and before.request_id is None
    ledger = Ledger(app.url)
    attempt = ledger.attempt("described:q3#1")
    [served] = fake.served()
    assert attempt.state == "settled" and attempt.actual == fake.state()["billed_total"]
    # the request id arrived with the response; it was written with the settlement
    assert attempt.request_id is not None and attempt.request_id == served.request_id
    assert ledger.audit() == []
    ledger.dispose()


def test_a_describe_call_that_returns_something_else_is_a_type_error_and_sends_nothing(
    app: Any, fake: FakeProvider
) -> None:
    with pytest.raises(TypeError, match="describe_call must return a CallFacts"):
        app.jobs["misdescribed"].delay("q4").get()
    ledger = Ledger(app.url)
    assert fake.served() == []
    assert ledger.attempts() == [] and ledger.holds() == []
    operation = ledger.operation("misdescribed:q4")
    assert (operation.status, operation.lease_owner) == ("pending", None)
    ledger.dispose()
