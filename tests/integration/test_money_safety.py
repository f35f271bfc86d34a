"""The money-safety failures the reviews found, each against the real ledger
(PostgreSQL and SQLite), the official openai SDK and the fake provider, through
BudgetTask in eager mode (the same flow a worker runs; the worker-only paths are in
test_workers.py and the races in test_races.py).

A recorded actual is proof of billing; an error the library raises before any send
never strands a hold; an operator's or beat's write never re-opens a finished
operation."""

from __future__ import annotations

import smtplib
import socket
import subprocess
import sys
import uuid
from datetime import timedelta
from typing import Any

import openai
import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import (
    BudgetExceeded,
    BudgetFrozen,
    BudgetTask,
    Ledger,
    LedgerUnavailable,
    OperationFailed,
)
from budget_tasks.beat import reconcile_unknown
from budget_tasks.config import close_ledgers
from budget_tasks.errors import StepNotReplayable
from budget_tasks.providers import estimates
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider, ManualClock
from tests.support.sdk_calls import openai_chat, openai_response


def request(text: str, tokens: int = 40) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "max_completion_tokens": tokens,
        "messages": [{"role": "user", "content": text}],
    }


ONE_CALL = estimates.openai_chat(request("x" * 40)).amount


def closed_port() -> int:
    """A loopback port nothing listens on (an SMTP server that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fault(spec: str) -> dict[str, Any]:
    return {"extra_headers": {"x-fake-fault": spec}}


class _Seen:
    """The task's ledger, whose calls face is ``calls``."""

    def __init__(self, ledger: Ledger, calls: Any) -> None:
        self._ledger, self.calls = ledger, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)


class _LedgerDownFor:
    """The task's calls ledger, except that reserving a key containing ``part`` fails
    as an unreachable database would."""

    def __init__(self, ledger: Any, part: str) -> None:
        self._ledger, self._part = ledger, part

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    def reserve(self, budget: str, key: str, amount: int, **kw: Any) -> Any:
        if self._part in key:
            raise LedgerUnavailable("connection refused (test)")
        return self._ledger.reserve(budget, key, amount, **kw)

    def admit_call(self, operation_id: int, call: Any, **kw: Any) -> Any:
        if self._part in call.step:  # a labelled call's admission reserves it
            raise LedgerUnavailable("connection refused (test)")
        return self._ledger.admit_call(operation_id, call, **kw)


class _AnswerLostFor(_LedgerDownFor):
    """The task's ledger, except that a labelled call's admission at ``part`` commits
    and its answer is lost, as with a connection cut during COMMIT."""

    def admit_call(self, operation_id: int, call: Any, **kw: Any) -> Any:
        admitted = self._ledger.admit_call(operation_id, call, **kw)
        if self._part in call.step:
            raise LedgerUnavailable("connection lost after COMMIT (test)")
        return admitted


@pytest.fixture
def app(backend_url: str, fake: FakeProvider) -> Any:
    close_ledgers()
    prefix = f"ms{uuid.uuid4().hex[:8]}"
    app = Celery("money-safety", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=2.0)
    ledger = Ledger(backend_url)
    ledger.create_budget("team", 10_000_000)
    ledger.dispose()
    smtp_port = closed_port()

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.billed_then",
        budget="team",
        idempotency_key=lambda doc, then: f"billed:{doc}",
        fingerprint=lambda doc, then: doc,
        estimate_cost=lambda doc, then: 2 * ONE_CALL,
    )
    def billed_then(self: BudgetTask, doc: str, then: str) -> Any:
        first = openai_chat(client, attempt=self.attempt, **request(doc))
        if then == "smtp":  # mailing the summary: the mail server refuses the connection
            smtplib.SMTP("127.0.0.1", smtp_port, timeout=2)
        elif then in ("404", "429"):  # a second call that the provider refuses
            openai_chat(client, attempt=self.attempt, **fault(f"status={then}"), **request(doc))
        elif then == "value":
            raise ValueError("post-processing failed")
        elif then == "deep":
            deep: list[Any] = []
            for _ in range(100_000):
                deep = [deep]
            return deep  # json.dumps raises RecursionError
        elif then == "object":
            return {"summary": object()}  # json.dumps raises TypeError
        return first.result["content"]

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.step_then",
        budget="team",
        idempotency_key=lambda doc, then: f"step:{doc}",
        fingerprint=lambda doc, then: doc,
        estimate_cost=lambda doc, then: 0,
    )
    def step_then(self: BudgetTask, doc: str, then: str) -> Any:
        with self.spend(ONE_CALL, "draft") as call:
            if not call.replayed:
                openai_chat(client, attempt=call, **request(doc))
                if then == "value":
                    raise ValueError("parsing the draft failed")
                call.result = "draft"
        return call.result

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.agent",
        budget="team",
        idempotency_key=lambda topic, faults=None: f"agent:{topic}",
        fingerprint=lambda topic, faults=None: topic,
        estimate_cost=lambda topic, faults=None: 0,
    )
    def agent(self: BudgetTask, topic: str, faults: dict[str, str] | None = None) -> Any:
        notes = []
        for step in ("one", "two"):
            with self.spend(ONE_CALL, step) as call:
                if not call.replayed:
                    extra = fault(faults[step]) if faults and step in faults else {}
                    sent = openai_chat(client, attempt=call, **extra, **request(topic))
                    call.result = sent.result["content"]
            notes.append(call.result)
        return notes

    class LedgerDown(BudgetTask):
        @property
        def ledger(self) -> Any:
            ledger = super().ledger
            return _Seen(ledger, _LedgerDownFor(ledger.calls, ":two:"))

    @app.task(
        base=LedgerDown,
        bind=True,
        name=f"{prefix}.agent_ledger_down",
        budget="team",
        idempotency_key=lambda topic: f"agent-down:{topic}",
        estimate_cost=lambda topic: 0,
    )
    def agent_ledger_down(self: BudgetTask, topic: str) -> Any:
        for step in ("one", "two"):
            with self.spend(ONE_CALL, step) as call:
                if not call.replayed:
                    openai_chat(client, attempt=call, **request(topic))
                    call.result = step
        return "done"

    answer_lost = app.answer_lost = {"on": True}

    class AnswerLost(BudgetTask):
        @property
        def ledger(self) -> Any:
            ledger = super().ledger
            if not answer_lost["on"]:
                return ledger
            return _Seen(ledger, _AnswerLostFor(ledger.calls, ":two:"))

    @app.task(
        base=AnswerLost,
        bind=True,
        name=f"{prefix}.agent_answer_lost",
        budget="team",
        idempotency_key=lambda topic: f"agent-lost:{topic}",
        estimate_cost=lambda topic: 0,
    )
    def agent_answer_lost(self: BudgetTask, topic: str) -> Any:
        return agent_ledger_down.run(topic)

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.resend",
        budget="team",
        on_unknown="resend",
        idempotency_key=lambda doc, fault_spec=None: f"resend:{doc}",
        fingerprint=lambda doc, fault_spec=None: doc,
        estimate_cost=lambda doc, fault_spec=None: ONE_CALL,
    )
    def resend(self: BudgetTask, doc: str, fault_spec: str | None = None) -> Any:
        extra = fault(fault_spec) if fault_spec else {}
        return openai_chat(client, attempt=self.attempt, **extra, **request(doc)).result["content"]

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.background",
        budget="team",
        idempotency_key=lambda doc: f"bg:{doc}",
        estimate_cost=lambda doc: (
            estimates.openai_response(
                {"model": "gpt-4o-mini", "input": doc, "max_output_tokens": 30}
            ).amount
        ),
    )
    def background(self: BudgetTask, doc: str) -> Any:
        sent = openai_response(
            client,
            attempt=self.attempt,
            model="gpt-4o-mini",
            input=doc,
            max_output_tokens=30,
            background=True,
            extra_headers={"x-fake-work-seconds": "1"},
        )
        return {"response_id": sent.response_id, "status": sent.result["status"]}

    app.jobs = {
        "background": background,
        "billed_then": billed_then,
        "step_then": step_then,
        "agent": agent,
        "agent_ledger_down": agent_ledger_down,
        "agent_answer_lost": agent_answer_lost,
        "resend": resend,
    }
    app.url = backend_url
    yield app
    close_ledgers()


def sent_for(fake: FakeProvider, prefix: str, ledger: Ledger) -> list[Any]:
    """The requests sent under ``ledger``'s attempt keys that start with ``prefix``."""
    return [s for s in fake.served_as(ledger) if (s.idempotency_key or "").startswith(prefix)]


# -- 1. a billed cost is settled, never released ------------------------------------


@pytest.mark.parametrize(
    ("then", "raised"),
    [
        ("smtp", ConnectionRefusedError),
        ("404", openai.NotFoundError),
        ("429", openai.RateLimitError),
        ("value", ValueError),
    ],
)
def test_an_error_after_a_billed_call_settles_it_and_never_sends_it_again(
    app: Any, fake: FakeProvider, then: str, raised: type[Exception]
) -> None:
    task = app.jobs["billed_then"]
    with pytest.raises(raised):
        task.delay(f"doc-{then}", then).get()
    ledger = Ledger(app.url)
    [attempt] = ledger.attempts()
    billed = fake.billed_for(attempt.key, ledger)
    assert billed > 0
    assert (attempt.state, attempt.actual) == ("settled", billed)  # not released at 0
    assert ledger.balance("team").spent == billed
    assert ledger.operation(f"billed:doc-{then}").status == "failed"
    sent = len(sent_for(fake, "billed:", ledger))
    # a redelivery reports the failure: the billed call is not sent again
    with pytest.raises(OperationFailed):
        task.delay(f"doc-{then}", then).get()
    assert len(sent_for(fake, "billed:", ledger)) == sent
    assert ledger.holds() == [] and ledger.audit() == []
    ledger.dispose()


def test_an_error_after_a_billed_spend_call_settles_it(app: Any, fake: FakeProvider) -> None:
    task = app.jobs["step_then"]
    with pytest.raises(ValueError, match="parsing"):
        task.delay("d1", "value").get()
    ledger = Ledger(app.url)
    [step] = [a for a in ledger.attempts() if a.label == "draft"]
    assert (step.state, step.actual) == ("settled", fake.billed_for(step.key, ledger))
    assert step.actual > 0
    # the billed call's answer was never stored: a rerun would send it again, so no rerun
    with pytest.raises(OperationFailed):
        task.delay("d1", "ok").get()
    assert len(sent_for(fake, "step:d1", ledger)) == 1
    assert ledger.holds() == [] and ledger.audit() == []
    ledger.dispose()


# -- 5. errors raised before any send never strand a hold ----------------------------


def test_budget_exceeded_in_a_step_strands_nothing_and_the_rerun_replays(
    app: Any, fake: FakeProvider
) -> None:
    ledger = Ledger(app.url)
    room = ledger.balance("team").available
    # leave room for exactly one step: the amount equal to what is left
    ledger.calls.reserve("team", "blocker", room - ONE_CALL)
    with pytest.raises(BudgetExceeded) as info:
        app.jobs["agent"].delay("pricing").get()
    # step one settled below its estimate; step two asks for a whole estimate again
    assert info.value.requested == ONE_CALL
    assert info.value.available == ONE_CALL - fake.billed_for("agent:pricing:one:1", ledger)
    attempts = {a.key: a for a in ledger.attempts()}
    # the run was admitted with step one: its main call, which reserves nothing, has no
    # attempt to leave unknown for good
    assert not [k for k in attempts if "#" in k]
    step_one = attempts["agent:pricing:one:1"]
    assert (step_one.state, step_one.actual) == ("settled", fake.billed_for(step_one.key, ledger))
    assert [h.key for h in ledger.holds()] == ["blocker"]
    assert ledger.operation("agent:pricing").status == "pending"
    # budget frees up: the next delivery replays step one and sends step two
    ledger.calls.release("blocker", "freed")
    assert len(app.jobs["agent"].delay("pricing").get()) == 2
    assert [s.idempotency_key for s in sent_for(fake, "agent:pricing", ledger)] == [
        "agent:pricing:one:1",
        "agent:pricing:two:1",
    ]
    assert ledger.holds() == [] and ledger.audit() == []
    ledger.dispose()


def test_a_step_released_after_a_429_is_a_new_attempt_on_the_next_run(
    app: Any, fake: FakeProvider
) -> None:
    task = app.jobs["agent"]
    with pytest.raises(openai.RateLimitError):
        task.delay("weather", {"one": "status=429"}).get()
    ledger = Ledger(app.url)
    assert ledger.operation("agent:weather").status == "retryable"
    assert len(task.delay("weather").get()) == 2
    steps = [(a.key, a.state, a.reason) for a in ledger.attempts() if a.label == "one"]
    # the same rule as the main call's: the attempt exists because of the rate limit
    assert steps == [
        ("agent:weather:one:1", "released", "first"),
        ("agent:weather:one:1~2", "settled", "rate_limited_retry"),
    ]
    assert [s.status for s in sent_for(fake, "agent:weather:one", ledger)] == [429, 200]
    assert ledger.operation("agent:weather").status == "succeeded"
    assert ledger.holds() == [] and ledger.audit() == []
    assert ledger.balance("team").spent == fake.state()["billed_total"]
    ledger.dispose()


def test_a_ledger_outage_before_a_step_is_sent_leaves_nothing_unknown(
    app: Any, fake: FakeProvider
) -> None:
    with pytest.raises(LedgerUnavailable):
        app.jobs["agent_ledger_down"].delay("t").get()
    ledger = Ledger(app.url)
    states = {a.key: a.state for a in ledger.attempts()}
    # (no main attempt: the run was admitted with step one)
    assert states == {"agent-down:t:one:1": "settled"}
    assert ledger.operation("agent-down:t").status == "pending"
    assert ledger.holds() == []
    assert [s.idempotency_key for s in fake.served_as(ledger)] == ["agent-down:t:one:1"]
    ledger.dispose()


def test_a_step_granted_as_the_ledger_went_away_is_released_not_left_unknown(
    app: Any, fake: FakeProvider
) -> None:
    """Step two's admission commits its grant and the answer is lost: nothing was sent
    under it, and this process knows so. As for the main call, what undoes the grant is
    owed under the run's lease and written when the ledger answers (here at the run's
    end): the hold is released, not left sending for reconciliation, and the next
    delivery sends step two anew."""
    task = app.jobs["agent_answer_lost"]
    with pytest.raises(LedgerUnavailable, match="after COMMIT"):
        task.delay("t").get()
    ledger = Ledger(app.url)
    states = {a.key: (a.state, a.note) for a in ledger.attempts()}
    assert states["agent-lost:t:two:1"][0] == "released"
    assert "never sent" in (states["agent-lost:t:two:1"][1] or "")
    assert states["agent-lost:t:one:1"][0] == "settled"
    assert ledger.operation("agent-lost:t").status == "pending"
    assert [s.idempotency_key for s in sent_for(fake, "agent-lost:", ledger)] == [
        "agent-lost:t:one:1"
    ]
    app.answer_lost["on"] = False
    assert task.delay("t").get() == "done"
    assert [s.idempotency_key for s in sent_for(fake, "agent-lost:", ledger)] == [
        "agent-lost:t:one:1",
        "agent-lost:t:two:1~2",
    ]
    assert ledger.holds() == [] and ledger.audit() == []
    assert ledger.balance("team").spent == fake.state()["billed_total"]
    ledger.dispose()


@pytest.mark.parametrize(
    ("job", "key", "called"),
    [("billed_then", "billed:lost", "billed:lost#"), ("step_then", "step:lost", "step:lost:")],
)
def test_a_billed_call_whose_answer_was_lost_is_resent_only_once_reopened(
    app: Any, fake: FakeProvider, job: str, key: str, called: str
) -> None:
    """One rule for the main call (call 0) and a labelled call: a billed call whose
    answer the operation did not keep is never sent again by an automatic retry, even
    where the operation is found retryable (its run's end was lost, say); an operator's
    reopen sends it again, as that call's next attempt."""
    task = app.jobs[job]
    with pytest.raises(ValueError, match="failed"):
        task.delay("lost", "value").get()
    ledger = Ledger(app.url)
    with ledger.engine.begin() as conn:  # as if the run's failed end never landed
        conn.execute(text("UPDATE operations SET status = 'retryable', error = NULL"))
    with pytest.raises(StepNotReplayable):
        task.delay("lost", "ok").get()
    assert len(sent_for(fake, called, ledger)) == 1
    assert ledger.operation(key).status == "failed"
    ledger.reopen_operation(key, reason="the customer asked again", by="test")
    task.delay("lost", "ok").get()
    sent = sent_for(fake, called, ledger)
    assert len(sent) == 2
    again = ledger.attempt(str(sent[1].idempotency_key))
    assert (again.reason, again.state) == ("manual", "settled")
    assert ledger.operation(key).status == "succeeded"
    assert ledger.holds() == [] and ledger.audit() == []
    assert ledger.balance("team").spent == fake.state()["billed_total"]
    ledger.dispose()


def test_a_refusal_after_a_reopen_keeps_it_and_the_task_runs_once_the_budget_frees(
    app: Any, fake: FakeProvider
) -> None:
    """An operator reopens a failed operation; its next delivery is refused for budget.
    The refusal runs nothing, so the reopen stands (pending with the refusal as its
    error, to be sent again as ``manual``); once the budget frees, the task runs again
    and succeeds."""
    task = app.jobs["billed_then"]
    key = "billed:refused"
    with pytest.raises(ValueError, match="failed"):
        task.delay("refused", "value").get()
    ledger = Ledger(app.url)
    ledger.reopen_operation(key, reason="the customer asked again", by="test")
    ledger.freeze("team", note="over budget for today", actor="test")
    with pytest.raises(BudgetFrozen):
        task.delay("refused", "ok").get()
    refused = ledger.operation(key)
    assert refused.status == "pending"
    assert "frozen" in (refused.error or "")
    with ledger.engine.connect() as conn:
        reason = conn.execute(
            text("SELECT next_reason FROM operations WHERE key = :key"), {"key": key}
        ).scalar_one()
    assert reason == "manual"
    ledger.unfreeze("team", actor="test")
    result = task.delay("refused", "ok").get()
    assert isinstance(result, str) and result
    sent = sent_for(fake, "billed:refused#", ledger)
    assert len(sent) == 2
    again = ledger.attempt(str(sent[1].idempotency_key))
    assert (again.reason, again.state) == ("manual", "settled")
    assert ledger.operation(key).status == "succeeded"
    assert ledger.holds() == [] and ledger.audit() == []
    assert ledger.balance("team").spent == fake.state()["billed_total"]
    ledger.dispose()


def test_step_keys_of_labels_and_keys_with_separators_never_collide(
    app: Any, fake: FakeProvider
) -> None:
    from budget_tasks.delivery.keys import main_key, step_key

    keys = {
        step_key("a:b", "c", 1),
        step_key("a", "b:c", 1),
        step_key("a:b:c", "x", 1),
        step_key("a", "b", 1, 2),
        main_key("a:b:1", 2),
        main_key("a:b:1~2", 1),
        step_key("a~1", "b", 1),
        step_key("a", "b#1", 1),
    }
    assert len(keys) == 8


# -- 7. a result that cannot be stored still settles and gives the lease back --------


@pytest.mark.parametrize("then", ["deep", "object"])
def test_a_result_that_cannot_be_stored_settles_the_call_and_frees_the_lease(
    app: Any, fake: FakeProvider, then: str
) -> None:
    with pytest.raises(TypeError, match="cannot be stored as JSON"):
        app.jobs["billed_then"].delay(f"r-{then}", then).get()
    ledger = Ledger(app.url)
    [attempt] = ledger.attempts()
    assert (attempt.state, attempt.actual) == ("settled", fake.billed_for(attempt.key, ledger))
    operation = ledger.operation(f"billed:r-{then}")
    assert (operation.status, operation.lease_owner) == ("failed", None)
    assert ledger.holds() == [] and ledger.audit() == []
    ledger.dispose()


# -- 3 and 8. beat and operators never re-open a finished operation ------------------


def _resend_succeeds_after_an_unknown(app: Any, fake: FakeProvider, doc: str) -> str:
    """Attempt 1 ends unknown (a 500 after sending), attempt 2 (the resend) succeeds."""
    task = app.jobs["resend"]
    with pytest.raises(openai.InternalServerError):
        task.delay(doc, "status=500").get()
    result: str = task.delay(doc).get()
    return result


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "budget_tasks.cli", *args, "--ledger-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("actual", ["0", "90"])
def test_an_operator_resolving_an_old_attempt_never_reopens_the_operation(
    app: Any, fake: FakeProvider, actual: str
) -> None:
    result = _resend_succeeds_after_an_unknown(app, fake, f"op-{actual}")
    key = f"resend:op-{actual}"
    done = cli(app.url, "resolve", f"{key}#1", "--actual", actual, "--note", "invoice")
    assert done.returncode == 0, done.stderr
    assert "operation resend:op-" in done.stdout and "not changed" in done.stdout
    ledger = Ledger(app.url)
    assert ledger.operation(key).status == "succeeded"
    # a duplicate enqueue replays: no third attempt, no OperationFailed
    assert app.jobs["resend"].delay(f"op-{actual}").get() == result
    assert [a.key for a in ledger.attempts()] == [f"{key}#1", f"{key}#2"]
    assert len(sent_for(fake, key, ledger)) == 2
    assert ledger.audit() == []
    ledger.dispose()


def test_an_operator_resolve_never_touches_a_live_run(app: Any, fake: FakeProvider) -> None:
    from budget_tasks.ledger.leases import owner_id

    ledger = Ledger(app.url)
    start = ledger.calls.admit(
        "live", fingerprint="f", owner="gone-run", lease=timedelta(seconds=1), max_runs=5
    )
    ledger.calls.reserve("team", "live#1", 100, operation_id=start.operation_id)
    ledger.calls.mark_sending("live#1")
    ledger.calls.mark_unknown("live#1", "timeout")
    ledger.calls.end_run("live", owner="gone-run")
    # a new delivery (this live process) resends as attempt 2 and is running it
    me = owner_id()
    again = ledger.calls.admit(
        "live", fingerprint="f", owner=me, lease=timedelta(minutes=5), max_runs=5
    )
    ledger.calls.reserve(
        "team", "live#2", 100, operation_id=again.operation_id, reason="unknown_resend"
    )
    ledger.calls.mark_sending("live#2")
    for target in ("live#1", "live#2"):
        done = cli(app.url, "resolve", target, "--actual", "0", "--note", "checked")
        assert done.returncode == 0, done.stderr
        operation = ledger.operation("live")
        assert (operation.status, operation.lease_owner) == ("running", me), target
    ledger.dispose()


def test_reconciling_an_old_attempt_never_reopens_a_succeeded_resend(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    result = _resend_succeeds_after_an_unknown(app, fake, "beat")
    plain = Ledger(backend_url)
    sent_at = plain.attempt("resend:beat#1").created_at
    plain.dispose()
    clock = ManualClock(sent_at + timedelta(hours=1))  # past the time it could still answer
    ledger = Ledger(backend_url, clock=clock)
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=2.0)
    requeued: list[Any] = []
    counts = reconcile_unknown(ledger, lambda kind: client, requeue=lambda *a: requeued.append(a))
    assert counts["not_found"] == 1
    assert ledger.attempt("resend:beat#1").state == "released"
    assert ledger.operation("resend:beat").status == "succeeded"
    assert requeued == []
    assert app.jobs["resend"].delay("beat").get() == result
    assert len(sent_for(fake, "resend:beat", ledger)) == 2
    assert ledger.holds() == [] and ledger.audit() == []
    ledger.dispose()


# -- a background response keeps its hold until its usage is known --------------------


def test_a_background_response_keeps_its_hold_until_reconciliation_reads_its_usage(
    app: Any, fake: FakeProvider
) -> None:
    import time

    result = app.jobs["background"].delay("Plan the quarter.").get()
    ledger = Ledger(app.url)
    [attempt] = ledger.attempts()
    # created, queued, nothing billed yet known: the hold stays (not settled at its estimate)
    assert (attempt.state, attempt.actual, attempt.response_id) == (
        "unknown",
        None,
        result["response_id"],
    )
    assert ledger.balance("team").held == attempt.amount
    assert ledger.operation("bg:Plan the quarter.").status == "succeeded"
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=2.0)
    assert reconcile_unknown(ledger, lambda kind: client)["pending"] == 1
    time.sleep(1.2)  # the provider finishes the work
    clock = ManualClock(ledger.now() + timedelta(hours=1))  # past the lookup's backoff
    later = Ledger(app.url, clock=clock)
    assert reconcile_unknown(later, lambda kind: client)["found"] == 1
    settled = later.attempt(attempt.key)
    assert (settled.state, settled.actual) == ("settled", fake.billed_for(attempt.key, ledger))
    assert settled.actual > 0 and not settled.estimate_only
    assert later.operation("bg:Plan the quarter.").result == result  # the task's own
    assert later.holds() == [] and later.audit() == []
    later.dispose()
    ledger.dispose()


def test_a_step_whose_outcome_is_unknown_holds_the_operation_until_beat_finds_it(
    app: Any, fake: FakeProvider
) -> None:
    from budget_tasks import OutcomeUnknown

    task = app.jobs["agent"]
    with pytest.raises(openai.APITimeoutError):
        task.delay("tide", {"two": "hang=3"}).get()  # billed, then the client gave up
    ledger = Ledger(app.url)
    states = {a.key: a.state for a in ledger.attempts()}
    assert states == {  # no main attempt: the run was admitted with step one
        "agent:tide:one:1": "settled",
        "agent:tide:two:1": "unknown",
    }
    assert ledger.operation("agent:tide").status == "unknown"  # not failed: it may be done
    with pytest.raises(OutcomeUnknown):
        task.delay("tide").get()  # the hold policy: no resend while it is unknown
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=2.0)
    assert reconcile_unknown(ledger, lambda kind: client)["found"] == 1
    assert ledger.operation("agent:tide").status == "retryable"
    notes = task.delay("tide").get()  # step one replays; step two replays what beat found
    assert len(notes) == 2 and notes[1]["id"]
    sent = [s.idempotency_key for s in sent_for(fake, "agent:tide", ledger)]
    assert sent == ["agent:tide:one:1", "agent:tide:two:1"]
    assert ledger.balance("team").spent == fake.state()["billed_total"]
    assert ledger.holds() == [] and ledger.audit() == []
    ledger.dispose()
