"""BudgetTask in task_always_eager mode (how users unit-test their own tasks), with a
real ledger (SQLite and PostgreSQL) and the official SDK against the fake provider."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import openai
import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import (
    BudgetExceeded,
    BudgetTask,
    IdempotencyConflict,
    Ledger,
    LedgerUnavailable,
    NotBilled,
    OperationFailed,
    OutcomeUnknown,
    ResendRefused,
    SideEffectUncertain,
)
from budget_tasks.errors import InvalidTransition, OperationInProgress
from budget_tasks.ledger import CallLedger
from budget_tasks.providers import estimates
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider
from tests.support.sdk_calls import openai_chat

from .test_delivery_stateful import gone_owner

LEASE = timedelta(minutes=10)


def request(text: str) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "max_completion_tokens": 64,
        "messages": [{"role": "user", "content": text}],
    }


@pytest.fixture
def app(backend_url: str, fake: FakeProvider) -> Any:
    prefix = f"eager{uuid.uuid4().hex[:8]}"  # task names are registered process-wide
    app = Celery("eager-tests", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=2.0)
    side_effects: list[str] = []

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.summarize",
        budget=lambda doc, text, fault=None: "tiny" if doc.startswith("tiny") else "team",
        idempotency_key=lambda doc, text, fault=None: f"sum:{doc}",
        estimate_cost=lambda doc, text, fault=None: estimates.openai_chat(request(text)).amount,
    )
    def summarize(
        self: BudgetTask, doc: str, text: str, fault: str | None = None
    ) -> dict[str, Any]:
        headers = {"x-fake-fault": fault} if fault else {}
        sent = openai_chat(
            client,
            key=self.attempt.key,
            on_request_id=self.attempt.record_request_id,
            extra_headers=headers,
            **request(text),
        )
        self.attempt.record(sent)
        return {"doc": doc, "summary": sent.result["content"], "cost": sent.cost}

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        estimate_cost=lambda n: 500,
        name=f"{prefix}.no_usage",
    )
    def no_usage(self: BudgetTask, n: int) -> int:
        return n * 2

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        estimate_cost=lambda: 500,
        name=f"{prefix}.refused",
    )
    def refused(self: BudgetTask) -> None:
        raise NotBilled("the provider rejected the prompt before generating")

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"{prefix}.agent",
        idempotency_key=lambda topic, crash=False: f"agent:{topic}",
        fingerprint=lambda topic, crash=False: topic,  # crash is a test switch
        estimate_cost=lambda topic, crash=False: 0,
    )
    def agent(self: BudgetTask, topic: str, crash: bool = False) -> dict[str, Any]:
        answers = []
        for _ in range(2):
            with self.spend(estimates.openai_chat(request(topic)).amount, "step") as call:
                if not call.replayed:
                    sent = openai_chat(client, key=call.key, **request(topic))
                    call.record(sent, result=sent.result["content"])
            answers.append(call.result)
        if crash:
            raise RuntimeError("worker lost after the calls")
        sent_mail = self.once("mail", lambda: side_effects.append(topic) or len(side_effects))
        return {"answers": answers, "mail": sent_mail}

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"{prefix}.resend",
        on_unknown="resend",
        idempotency_key=lambda doc, fault=None: f"resend:{doc}",
        fingerprint=lambda doc, fault=None: doc,
        estimate_cost=lambda doc, fault=None: estimates.openai_chat(request(doc)).amount,
    )
    def resend(self: BudgetTask, doc: str, fault: str | None = None) -> int:
        headers = {"x-fake-fault": fault} if fault else {}
        sent = openai_chat(client, key=self.attempt.key, extra_headers=headers, **request(doc))
        self.attempt.record(sent)
        return sent.cost or 0

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"{prefix}.resend_step",
        on_unknown="resend",
        idempotency_key=lambda topic: f"moved:{topic}",
        fingerprint=lambda topic: topic,
        estimate_cost=lambda topic: 0,
    )
    def resend_step(self: BudgetTask, topic: str) -> Any:
        with self.spend(estimates.openai_chat(request(topic)).amount, "step") as call:
            if not call.replayed:
                sent = openai_chat(client, key=call.key, **request(topic))
                call.record(sent, result=sent.result["content"])
        return call.result

    app.side_effects = side_effects
    app.jobs = {
        "summarize": summarize,
        "no_usage": no_usage,
        "refused": refused,
        "agent": agent,
        "resend": resend,
        "resend_step": resend_step,
    }
    Ledger(backend_url).create_budget("team", 1_000_000)
    Ledger(backend_url).create_budget("tiny", 1)
    return app


def test_first_run_reserves_sends_once_and_settles_the_billed_cost(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    result = app.jobs["summarize"].delay("d1", "Quarterly numbers are up.").get()
    ledger = Ledger(backend_url)
    [attempt] = ledger.attempts()
    assert attempt.key == "sum:d1#1"
    assert (attempt.state, attempt.reason, attempt.estimate_only) == ("settled", "first", False)
    assert attempt.actual == result["cost"] == fake.billed_for("sum:d1#1") > 0
    assert attempt.request_id == fake.served()[0].request_id
    assert ledger.balance("team").spent == result["cost"]
    assert ledger.balance("team").held == 0
    assert ledger.audit() == []


def test_same_business_key_replays_without_a_provider_call(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    task = app.jobs["summarize"]
    first = task.delay("d2", "Text.").get()
    again = task.delay("d2", "Text.").get()  # another task id, the same business key
    assert again == first
    assert len(fake.served()) == 1
    assert Ledger(backend_url).balance("team").spent == first["cost"]
    with pytest.raises(IdempotencyConflict):
        task.delay("d2", "Other text.").get()  # same key, another request
    assert len(fake.served()) == 1


def test_a_run_without_usage_is_charged_its_reservation(app: Any, backend_url: str) -> None:
    assert app.jobs["no_usage"].delay(21).get() == 42
    [attempt] = Ledger(backend_url).attempts()
    assert (attempt.actual, attempt.estimate_only) == (500, True)


def test_not_billed_releases_and_fails_for_good(app: Any, backend_url: str) -> None:
    task = app.jobs["refused"]
    with pytest.raises(NotBilled):
        task.apply(task_id="refused-1")
    ledger = Ledger(backend_url)
    [attempt] = ledger.attempts()
    assert (attempt.state, attempt.actual) == ("released", 0)
    assert ledger.balance("team").held == 0
    with pytest.raises(OperationFailed, match="NotBilled"):
        task.apply(task_id="refused-1")
    assert len(ledger.attempts()) == 1


def test_a_timeout_keeps_the_hold_and_is_never_resent(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    task = app.jobs["summarize"]
    with pytest.raises(openai.APITimeoutError):
        task.delay("d3", "Slow one.", "hang=3").get()
    ledger = Ledger(backend_url)
    [attempt] = ledger.attempts()
    assert attempt.state == "unknown"
    assert ledger.balance("team").held == attempt.amount
    with pytest.raises(OutcomeUnknown):
        task.delay("d3", "Slow one.", "hang=3").get()
    assert len([s for s in fake.served() if s.idempotency_key == "sum:d3#1"]) == 1
    assert len(ledger.attempts()) == 1


def test_budget_exceeded_fails_without_a_send(app: Any, fake: FakeProvider) -> None:
    with pytest.raises(BudgetExceeded) as info:
        app.jobs["summarize"].delay("tiny-1", "Too dear for a budget of 1.").get()
    assert (info.value.budget, info.value.available) == ("tiny", 1)
    assert fake.served() == []


def test_an_error_after_stored_steps_fails_the_operation_and_charges_each_step_once(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    task = app.jobs["agent"]
    with pytest.raises(RuntimeError):
        task.delay("pricing", True).get()
    assert len(fake.served()) == 2  # both steps were sent and settled
    ledger = Ledger(backend_url)
    # The main call reserved nothing: the run, admitted with its first step's admission,
    # made no attempt for it (nothing could ever be sent under one).
    assert [a for a in ledger.attempts() if a.label is None] == []
    # An error raised by run() fails the operation for good: a redelivery reports it
    # and sends nothing.
    with pytest.raises(OperationFailed, match="worker lost after the calls"):
        task.delay("pricing", False).get()
    assert len(fake.served()) == 2
    assert app.side_effects == []
    steps = [a for a in ledger.attempts() if a.label == "step"]
    assert [a.state for a in steps] == ["settled", "settled"]
    assert sum(a.actual for a in steps) == fake.state()["billed_total"]
    assert ledger.audit() == []


def test_once_that_died_midway_is_not_repeated(app: Any, backend_url: str) -> None:
    ledger = Ledger(backend_url)
    task = app.jobs["agent"]
    task.delay("mail-crash", False).get()
    # Simulate a run that claimed the side effect and died before recording its end.
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE side_effects SET state = 'started', result = NULL WHERE name = 'once:mail'"
            )
        )
        conn.execute(text("UPDATE operations SET status = 'retryable', result = NULL"))
    with pytest.raises(SideEffectUncertain):
        task.delay("mail-crash", False).get()


def test_a_429_releases_and_the_retry_is_a_new_attempt(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    task = app.jobs["summarize"]
    fake.plan("status=429")
    with pytest.raises(openai.RateLimitError):
        task.delay("d429", "Busy provider.").get()
    ledger = Ledger(backend_url)
    [first] = ledger.attempts()
    assert (first.state, first.actual) == ("released", 0)
    task.delay("d429", "Busy provider.").get()
    second = ledger.attempt("sum:d429#2")
    assert (second.reason, second.state) == ("rate_limited_retry", "settled")
    assert ledger.balance("team").spent == second.actual
    assert [s.status for s in fake.served()] == [429, 200]


def test_on_unknown_resend_makes_a_new_attempt_and_keeps_the_old_hold(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    task = app.jobs["resend"]
    with pytest.raises(openai.APITimeoutError):
        task.delay("r1", "hang=3").get()
    cost = task.delay("r1").get()
    ledger = Ledger(backend_url)
    first, second = ledger.attempt("resend:r1#1"), ledger.attempt("resend:r1#2")
    assert (first.state, second.state) == ("unknown", "settled")
    assert second.reason == "unknown_resend"
    bal = ledger.balance("team")
    assert (bal.held, bal.spent) == (first.amount, cost)


def test_a_missing_or_bad_estimate_fails_before_anything_is_reserved(
    backend_url: str, fake: FakeProvider
) -> None:
    app = Celery("estimates", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    prefix = f"est{uuid.uuid4().hex[:8]}"
    Ledger(backend_url).create_budget("team", 1_000)

    @app.task(base=BudgetTask, bind=True, budget="team", name=f"{prefix}.missing")
    def missing(self: BudgetTask) -> int:
        return 1

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"{prefix}.floaty",
        estimate_cost=lambda: 12.5,
    )
    def floaty(self: BudgetTask) -> int:
        return 1

    with pytest.raises(NotImplementedError, match="set estimate_cost"):
        missing.delay().get()
    with pytest.raises(TypeError, match="int of minor units"):
        floaty.delay().get()
    ledger = Ledger(backend_url)
    assert ledger.attempts() == []
    assert ledger.balance("team").held == 0
    assert fake.served() == []


def test_an_unreachable_ledger_means_no_send(fake: FakeProvider) -> None:
    app = Celery("down", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        budget_ledger_url="postgresql+psycopg://postgres@127.0.0.1:1/nowhere",
    )
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=2.0)

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"down{uuid.uuid4().hex}",
        estimate_cost=lambda: 100,
    )
    def call(self: BudgetTask) -> int:
        return openai_chat(client, key=self.attempt.key, **request("hello")).cost or 0

    with pytest.raises(LedgerUnavailable, match=r"^ledger unavailable: connection failed"):
        call.delay().get()
    assert fake.served() == []


def test_an_idempotency_key_leaves_room_for_its_attempt_keys(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    """A key of exactly the limit runs (its attempt key ``key#1`` fits the ledger); one
    character more, or a step whose keys would not fit, is refused before anything is
    reserved or sent."""
    task = app.jobs["summarize"]
    at_limit = "d" * (200 - len("sum:"))
    assert task.delay(at_limit, "Text.").get()["cost"] > 0
    ledger = Ledger(backend_url)
    [attempt] = ledger.attempts()
    assert attempt.key == f"sum:{at_limit}#1" and attempt.state == "settled"
    with pytest.raises(ValueError, match="at most 200"):
        task.delay(at_limit + "d", "Text.").get()

    # a step's keys ('key:label:n', '~n' later) must fit too
    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"long-label-{uuid.uuid4().hex[:8]}",
        idempotency_key=lambda: "k" * 200,
        estimate_cost=lambda: 0,
    )
    def long_label(self: BudgetTask) -> None:
        with self.spend(100, "l" * 60):
            raise AssertionError("never granted")

    with pytest.raises(ValueError, match="shorter label or idempotency key"):
        long_label.delay().get()
    assert len(fake.served()) == 1
    assert [a.key for a in ledger.attempts() if a.key.startswith("k")] == ["k" * 200 + "#1"]
    assert ledger.balance("team").held == 0
    ledger.dispose()


def test_a_resend_under_the_main_attempt_after_a_timeout_is_refused_before_sending(
    backend_url: str, fake: FakeProvider
) -> None:
    """User code catches the SDK's timeout (the provider billed) and calls again under
    the same main attempt: the second call is refused before it is sent, the hold stays
    as unknown for reconciliation, and the provider is asked once. (It used to be sent:
    billed twice, and the attempt settled at the second call's usage alone.)"""
    app = Celery("resend", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=0.5)
    body = request("Retried by hand.")
    tries: list[str] = []

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"resend{uuid.uuid4().hex[:8]}",
        idempotency_key=lambda n: f"resend:{n}",
        estimate_cost=lambda n: estimates.openai_chat(body).amount,
    )
    def ask(self: BudgetTask, n: int) -> str:
        for _ in range(2):
            try:
                tries.append("sent")
                return str(openai_chat(client, attempt=self.attempt, **body).result["content"])
            except openai.APITimeoutError:
                continue
        return "gave up"

    Ledger(backend_url).create_budget("team", 10_000_000)
    fake.plan("hang=1.5", count=1, path="/chat/completions")
    try:
        with pytest.raises(ResendRefused):
            ask.delay(1).get()
        assert tries == ["sent", "sent"]  # the second try reached the refusal
        ledger = Ledger(backend_url)
        assert len([s for s in fake.served_as(ledger) if s.method == "POST"]) == 1
        attempt = ledger.attempt("resend:1#1")
        assert attempt.state == "unknown" and ledger.balance("team").held == attempt.amount
        assert ledger.operation("resend:1").status == "unknown"
        with pytest.raises(OutcomeUnknown):  # and no redelivery sends it again
            ask.delay(1).get()
        assert len([s for s in fake.served() if s.method == "POST"]) == 1
    finally:
        app.close()


@pytest.mark.parametrize("same_amount", [True, False], ids=["same-amount", "re-estimated"])
def test_an_attempt_reserved_and_never_sent_is_reused_or_replaced_for_every_call(
    app: Any, backend_url: str, fake: FakeProvider, same_amount: bool
) -> None:
    """A run that died between a reservation and its send left the attempt reserved.
    The next delivery sends under it when it asks the same amount; re-estimated, it
    releases it and sends under a new attempt. One rule for the main call (resend:d#n)
    and for a labelled one (agent:t:step:1~n)."""
    ledger = Ledger(backend_url)
    bound = estimates.openai_chat(request("d")).amount
    left = bound if same_amount else bound + 1
    for operation, fingerprint, key, options in (
        ("resend:d", "d", "resend:d#1", {}),
        ("agent:d", "d", "agent:d:step:1", {"label": "step", "step": "agent:d:step:1"}),
    ):
        dead = ledger.calls.admit(
            operation, fingerprint=fingerprint, owner=gone_owner(), lease=LEASE, max_runs=5
        )
        ledger.calls.reserve("team", key, left, operation_id=dead.operation_id, **options)
    assert app.jobs["resend"].delay("d").get() > 0
    assert len(app.jobs["agent"].delay("d").get()["answers"]) == 2
    sent = [s.idempotency_key for s in fake.served_as(ledger) if s.method == "POST"]
    if same_amount:
        assert sent == ["resend:d#1", "agent:d:step:1", "agent:d:step:2"]
    else:
        assert sent == ["resend:d#2", "agent:d:step:1~2", "agent:d:step:2"]
        for key in ("resend:d#1", "agent:d:step:1"):
            attempt = ledger.attempt(key)
            assert (attempt.state, attempt.actual) == ("released", 0), key
    assert ledger.balance("team").held == 0 and ledger.audit() == []
    ledger.dispose()


@pytest.mark.parametrize("moved", [False, True], ids=["found-sending", "moved-meanwhile"])
def test_a_dead_runs_labelled_call_is_resent_on_unknown_unless_it_moved(
    app: Any, backend_url: str, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, moved: bool
) -> None:
    """on_unknown="resend": a dead run's labelled call found sending is marked unknown
    when the next delivery begins and sent again as a new attempt (``~2``), as a main
    call is. If marking it says it moved meanwhile (beat settled it, say), nothing is
    sent on that stale read: the delivery reads again and, still refused, comes back
    later (OperationInProgress, Celery's retry)."""
    one_step = app.jobs["resend_step"]
    ledger = Ledger(backend_url)
    dead = ledger.calls.admit(
        "moved:t", fingerprint="t", owner=gone_owner(), lease=LEASE, max_runs=5
    )
    bound = estimates.openai_chat(request("t")).amount
    step = "moved:t:step:1"
    ledger.calls.reserve(
        "team", step, bound, operation_id=dead.operation_id, label="step", step=step
    )
    ledger.calls.mark_sending(step)
    if moved:

        def moved_meanwhile(self: CallLedger, key: str, *args: Any, **kwargs: Any) -> bool:
            raise InvalidTransition(key, "settled", "mark it unknown")

        monkeypatch.setattr(CallLedger, "mark_unknown", moved_meanwhile)
        with pytest.raises(OperationInProgress):
            one_step.delay("t").get()
        assert [s for s in fake.served() if s.method == "POST"] == []
        assert ledger.attempt(step).state == "sending"  # nothing written on a stale read
    else:
        assert one_step.delay("t").get()
        sent = [s.idempotency_key for s in fake.served_as(ledger) if s.method == "POST"]
        assert sent == [f"{step}~2"]
        assert ledger.attempt(step).state == "unknown"  # kept: the resend pays its own hold
    ledger.dispose()
